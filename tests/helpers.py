"""Shared test helpers."""

from __future__ import annotations

import torch

from snac_fast.configs import published_config
from snac_fast.streaming import StreamEngine
from snac_fast.testing import synthetic_model

# a published model's structure (strides, attention windows, receptive field) at 1/4 to 1/6 of its
# channel widths: for tests whose check is not about full-width tiles, the interpreter runs it fast
NARROW = {"decoder_dim": 256, "encoder_dim": 16}

# A float32 snac-fast decode against upstream's with the same noise measures 122-123 dB and a max
# error under 7e-7 (CPU); a 1e-4 relative error in one Snake alpha or conv weight costs 86-104 dB
# and 5e-6-4e-5 (tests/test_fastsnac.py's mutation test). Both bounds sit between.
FP32_UPSTREAM_SNR_DB = 110.0
FP32_UPSTREAM_MAX_ERROR = 2e-6


def assert_matches_upstream_fp32(expected: torch.Tensor, got: torch.Tensor) -> None:
    """A float32 snac-fast output against upstream's: SNR and max error both within the bounds."""
    from snac_fast.metrics import max_abs_error, snr_db

    snr, error = snr_db(expected, got), max_abs_error(expected, got)
    assert snr >= FP32_UPSTREAM_SNR_DB and error <= FP32_UPSTREAM_MAX_ERROR, f"{snr:.1f} dB, max error {error:.2e}"


def random_codes(config: dict, coarse: int, batch: int = 1, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    strides = config["vq_strides"]
    return [torch.randint(0, config["codebook_size"], (batch, coarse * strides[0] // s), generator=gen) for s in strides]


_UPSTREAM: dict = {}


def upstream64(name: str, narrow: bool = False):
    """Upstream's synthetic model in float64 (cached): the reference the stream tests decode with."""
    if (name, narrow) not in _UPSTREAM:
        _UPSTREAM[name, narrow] = synthetic_model(name, **NARROW if narrow else {}).double()
    return _UPSTREAM[name, narrow]


def engine64(name: str, streams: int = 4, narrow: bool = False, **options) -> StreamEngine:
    """A float64 stream engine over :func:`upstream64` (torch ops: fast and exact on the CPU)."""
    config = {**published_config(name), **(NARROW if narrow else {})}
    return StreamEngine(upstream64(name, narrow), config, streams, dtype=torch.float64, **options)


def frames_of(codes: list[torch.Tensor], strides: list[int], start: int, stop: int, row: int = 0) -> list[torch.Tensor]:
    """Coarse frames [start, stop) of row ``row`` of ``codes``: per level [1, L_i]."""
    return [c[row:row + 1, start * strides[0] // s:stop * strides[0] // s] for c, s in zip(codes, strides)]
