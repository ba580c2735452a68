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


@contextlib.contextmanager
def seeded_noise(model: nn.Module, seed: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """Inside the block, every NoiseBlock of ``model`` draws its [B, 1, T] noise in float32 from one
    generator on ``device`` seeded with ``seed``, then casts it to the activation's device and dtype.

    Two models with the same architecture, entered with the same seed and device, receive identical
    noise whatever their own devices and dtypes (use device="cpu" to compare across devices).
    """
    generator = torch.Generator(device=device).manual_seed(seed)

    def noisy_forward(block: nn.Module):
        def forward(x: torch.Tensor) -> torch.Tensor:
            noise = torch.randn((x.shape[0], 1, x.shape[2]), generator=generator, device=generator.device)
            return x + noise.to(device=x.device, dtype=x.dtype) * block.linear(x)

        return forward

    blocks = noise_blocks(model)
    for block in blocks:
        block.forward = noisy_forward(block)  # instance attribute: class, tree and weights unchanged
    try:
        yield
    finally:
        for block in blocks:
            del block.forward
