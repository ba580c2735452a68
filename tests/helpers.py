"""Shared test helpers."""

from __future__ import annotations

import torch

# a published model's structure (strides, attention windows, receptive field) at 1/4 to 1/6 of its
# channel widths: for tests whose check is not about full-width tiles, the interpreter runs it fast
NARROW = {"decoder_dim": 256, "encoder_dim": 16}


def random_codes(config: dict, coarse: int, batch: int = 1, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    strides = config["vq_strides"]
    return [torch.randint(0, config["codebook_size"], (batch, coarse * strides[0] // s), generator=gen) for s in strides]
