"""The kinds of stream step and the batch shapes they run at."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

PREFILL, STEP, FLUSH = "prefill", "step", "flush"
TAIL = "tail"  # an approximate stream's flush, cut to the audio its emission needs
CODELESS = (FLUSH, TAIL)  # the kinds that take no new codes


def bucket_rows(n: int) -> int:
    """Rows of the step graph that runs ``n`` streams: the next power of two up to 32, then the
    next of 2^k and 1.5 * 2^k (48, 64, 96, 128, 192, ...). A step's GPU time grows about linearly
    past ~64 rows, so a call of 65 streams padded to 128 rows spent half its time on padding."""
    top = 1 << (n - 1).bit_length()
    return top if top <= 32 or n > 3 * top // 4 else 3 * top // 4


def warmup_buckets(max_batch: int) -> list[int]:
    """The step-graph rows of every batch of 1 to ``max_batch`` streams (what a warm-up captures)."""
    sizes = [1 << i for i in range(max_batch.bit_length() + 1)] + [3 << i for i in range(max_batch.bit_length())]
    return sorted({bucket_rows(min(size, max_batch)) for size in sizes})


def slots_of(streams: Sequence) -> np.ndarray:
    """The state slots of ``streams`` (:class:`~snac_fast.streaming.StreamSlot`), int64 [len(streams)]."""
    return np.fromiter((s.slot for s in streams), np.int64, len(streams))


def joined_audio(pieces: Sequence[Tensor]) -> tuple[Tensor, np.ndarray]:
    """1-D audio pieces -> (one buffer, offsets int64 [len(pieces) + 1]) as :meth:`~snac_fast.streaming.StreamEngine.step_rows` returns."""
    offsets = np.zeros(len(pieces) + 1, np.int64)
    np.cumsum([p.numel() for p in pieces], out=offsets[1:])
    return torch.cat(list(pieces)), offsets
