"""Where kernels run: CUDA tensors use compiled Triton; CPU tensors use Triton's interpreter when
``TRITON_INTERPRET=1`` was set before import (how CI tests kernels), else the torch reference."""

from __future__ import annotations

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
