"""Shared test helpers."""

from __future__ import annotations

import torch


def random_codes(config: dict, coarse: int, batch: int = 1, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    strides = config["vq_strides"]
    return [torch.randint(0, config["codebook_size"], (batch, coarse * strides[0] // s), generator=gen) for s in strides]
