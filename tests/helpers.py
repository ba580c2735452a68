"""Shared test helpers: random codes for a config, the same-noise upstream decode."""

from __future__ import annotations

import torch

from snac_fast.noise import seeded_noise


def random_codes(config: dict, coarse: int, batch: int = 1, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    strides = config["vq_strides"]
    return [torch.randint(0, config["codebook_size"], (batch, coarse * strides[0] // s), generator=gen) for s in strides]


def upstream_decode(model, codes, seed: int) -> torch.Tensor:
    """Decode with upstream's own modules, NoiseBlock noise drawn from a CPU generator."""
    with torch.inference_mode(), seeded_noise(model, seed, "cpu"):
        return model.decode(codes)
