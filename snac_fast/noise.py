"""Reproducible NoiseBlock noise: SNAC's decoder draws fresh Gaussian noise on every call, so two
decodes (or two models) only match when they are fed the same noise."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


def noise_blocks(model: nn.Module) -> list[nn.Module]:
    from snac.layers import NoiseBlock

    return [m for m in model.modules() if isinstance(m, NoiseBlock)]


def draw(shape: tuple[int, ...], generator: torch.Generator | None, like: torch.Tensor) -> torch.Tensor:
    """float32 Gaussian noise from ``generator`` (None: the global RNG of ``like``'s device), cast to
    ``like``'s device and dtype. Every noise path (eager, seeded, CUDA graphs) draws through here."""
    device = generator.device if generator is not None else like.device
    return torch.randn(shape, generator=generator, device=device).to(device=like.device, dtype=like.dtype)


@contextlib.contextmanager
def injected_noise(model: nn.Module, generator: torch.Generator) -> Iterator[None]:
    """Inside the block, every NoiseBlock of ``model`` draws its [B, 1, T] noise from ``generator``
    (see :func:`draw`), in call order. Fused blocks get a new ``draw_noise``; upstream ones a new
    ``forward`` computing upstream's ``x + noise * linear(x)``. Instance attributes only: class,
    tree and weights are unchanged, and everything is restored on exit."""

    def noise_for(x: torch.Tensor) -> torch.Tensor:
        return draw((x.shape[0], 1, x.shape[2]), generator, x)

    def upstream_forward(block: nn.Module):
        def forward(x: torch.Tensor) -> torch.Tensor:
            return x + noise_for(x) * block.linear(x)

        return forward

    patched = []
    for block in noise_blocks(model):
        name = "draw_noise" if hasattr(block, "draw_noise") else "forward"
        setattr(block, name, noise_for if name == "draw_noise" else upstream_forward(block))
        patched.append((block, name))
    try:
        yield
    finally:
        for block, name in patched:
            delattr(block, name)


def seeded_noise(model: nn.Module, seed: int, device: torch.device | str = "cpu"):
    """:func:`injected_noise` from a fresh generator on ``device`` seeded with ``seed``.

    Two models with the same architecture, entered with the same seed and device, receive identical
    noise whatever their own devices and dtypes (use device="cpu" to compare across devices).
    """
    return injected_noise(model, torch.Generator(device=device).manual_seed(seed))
