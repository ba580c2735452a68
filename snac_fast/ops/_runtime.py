"""Where kernels run: CUDA tensors use compiled Triton; CPU tensors use Triton's interpreter when
``TRITON_INTERPRET=1`` was set before import (how CI tests kernels), else the torch reference."""

from __future__ import annotations

import functools
import os

import torch

try:  # Triton is a Linux-only dependency; without it every op takes its torch reference path.
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on platforms without Triton
    HAS_TRITON = False

# triton.jit decides compiled-vs-interpreted when a kernel is defined, so read the switch once, here.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def runs_triton(t: torch.Tensor) -> bool:
    """True when ``t``'s device can run our Triton kernels in this process."""
    if not HAS_TRITON:
        return False
    if t.device.type == "cuda":
        return not TRITON_INTERPRET
    return t.device.type == "cpu" and TRITON_INTERPRET


def wave_programs(device: torch.device) -> int:
    """How many programs a launch needs to occupy ``device``: its SM count rounded down to a power
    of two (128 on H100/H200). 1 for Triton's interpreter, which pays per program: biggest tiles."""
    if device.type != "cuda" or TRITON_INTERPRET:
        return 1
    return _wave_programs(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _wave_programs(index: int) -> int:
    return 1 << (torch.cuda.get_device_properties(index).multi_processor_count.bit_length() - 1)


def first_filling(tiles: list[tuple[int, ...]], programs, target: int) -> tuple[int, ...]:
    """The first tile (in order of preference, biggest first) whose launch has at least ``target``
    programs, else the last. Small problems get small tiles so that every SM works: at streaming
    sizes a decoder kernel is latency-bound, not bandwidth-bound (scripts/tune_tiles.py)."""
    for tile in tiles:
        if programs(tile) >= target:
            return tile
    return tiles[-1]
