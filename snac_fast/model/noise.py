"""NoiseBlock noise: SNAC's decoder draws fresh Gaussian noise on every call, so two decodes (or two
models) only match when they are fed the same noise. Two reproducible sources:

- keyed (``decode(codes, seed=s)``, streams): each value is a function of (seed, row, NoiseBlock
  index, absolute sample index) (:func:`snac_fast.ops.noise.keyed_normal`), so a stream cut into any
  pushes, or a decode of a prefix, gets the same noise as the whole decode;
- a torch.Generator drawn in call order (``decode(codes, generator=g)``, fidelity checks and the
  reference files in samples/reference/), which upstream models can be fed too.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from snac_fast.ops.noise import keyed_normal

# noise for NoiseBlock number ``index`` (module order) given its input x [B, C, T]: [B, 1, T] in x's dtype
NoiseSource = Callable[[int, Tensor], Tensor]


def check_seed(seed: object) -> int:
    """A seed for keyed noise: an int in [-2**63, 2**63) (its 64 bits are the Philox key)."""
    if isinstance(seed, bool) or not isinstance(seed, int) and not (isinstance(seed, torch.Tensor) and seed.numel() == 1
                                                                  and not seed.dtype.is_floating_point):
        raise ValueError(f"seed must be an integer, got {type(seed).__name__}")
    seed = int(seed)
    if not -(1 << 63) <= seed < 1 << 63:
        raise ValueError(f"seed must fit in 64 signed bits, got {seed}")
    return seed


def noise_blocks(model: nn.Module) -> list[nn.Module]:
    from snac.layers import NoiseBlock

    return [m for m in model.modules() if isinstance(m, NoiseBlock)]


def draw(shape: tuple[int, ...], generator: torch.Generator | None, like: torch.Tensor) -> torch.Tensor:
    """float32 Gaussian noise from ``generator`` (None: the global RNG of ``like``'s device), cast to
    ``like``'s device and dtype. Every generator-driven noise path (eager, CUDA graphs) draws here."""
    device = generator.device if generator is not None else like.device
    return torch.randn(shape, generator=generator, device=device).to(device=like.device, dtype=like.dtype)


@contextlib.contextmanager
def patched_noise(model: nn.Module, source: NoiseSource) -> Iterator[None]:
    """Inside the block, NoiseBlock number i of ``model`` takes its noise from ``source(i, x)``.
    Fused blocks get a new ``draw_noise``; upstream ones a new ``forward`` computing upstream's
    ``x + noise * linear(x)``. Instance attributes only: class, tree and weights are unchanged, and
    everything is restored on exit."""

    def upstream_forward(block: nn.Module, noise_for: Callable[[Tensor], Tensor]):
        def forward(x: torch.Tensor) -> torch.Tensor:
            return x + noise_for(x) * block.linear(x)

        return forward

    patched = []
    for index, block in enumerate(noise_blocks(model)):
        noise_for = (lambda i: lambda x: source(i, x))(index)
        name = "draw_noise" if hasattr(block, "draw_noise") else "forward"
        setattr(block, name, noise_for if name == "draw_noise" else upstream_forward(block, noise_for))
        patched.append((block, name))
    try:
        yield
    finally:
        for block, name in patched:
            delattr(block, name)


def injected_noise(model: nn.Module, generator: torch.Generator):
    """Every NoiseBlock draws its [B, 1, T] noise from ``generator`` (see :func:`draw`), in call order."""
    return patched_noise(model, lambda index, x: draw((x.shape[0], 1, x.shape[2]), generator, x))


def seeded_noise(model: nn.Module, seed: int, device: torch.device | str = "cpu"):
    """:func:`injected_noise` from a fresh generator on ``device`` seeded with ``seed``.

    Two models with the same architecture, entered with the same seed and device, receive identical
    noise whatever their own devices and dtypes (use device="cpu" to compare across devices).
    """
    return injected_noise(model, torch.Generator(device=device).manual_seed(seed))


@contextlib.contextmanager
def keyed_noise(model: nn.Module, seeds: Tensor, rows: Tensor | None = None, frames: Tensor | None = None) -> Iterator[None]:
    """NoiseBlock i of ``model`` gets :func:`keyed_normal` noise for row b from key (seeds[b],
    rows[b] (default b), i) at positions 0..T-1: what ``decode(codes, seed=s)`` feeds with seeds
    all s. seeds, rows, frames (the frame offsets, default zeros): int64 [B] on the model's device.
    Under CUDA graphs all three must be static buffers that outlive the graph (the defaults are
    made here)."""
    rows = torch.arange(seeds.shape[0], device=seeds.device) if rows is None else rows
    frames = torch.zeros_like(seeds) if frames is None else frames

    def source(index: int, x: Tensor) -> Tensor:
        return keyed_normal(seeds, rows, frames, 0, 0, x.shape[2], index, dtype=x.dtype)

    with patched_noise(model, source):
        yield


def decode_with_keyed_noise(model: nn.Module, codes: list[Tensor], seed: int) -> Tensor:
    """Any SNAC (upstream or snac-fast's tree) decoding ``codes`` with the noise of
    ``FastSNAC.decode(codes, seed=seed)``, on the model's device and dtype."""
    device = next(model.parameters()).device
    seeds = torch.full((codes[0].shape[0],), seed, dtype=torch.int64, device=device)
    with torch.inference_mode(), keyed_noise(model, seeds):
        return model.decode([c.to(device) for c in codes])
