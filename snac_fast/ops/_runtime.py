"""Where kernels run: CUDA tensors use compiled Triton; CPU tensors use Triton's interpreter when
``TRITON_INTERPRET=1`` was set before import (how CI tests kernels), else the torch reference."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

try:  # Triton is a Linux-only dependency; without it every op takes its torch reference path.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on platforms without Triton
    HAS_TRITON = False

# triton.jit decides compiled-vs-interpreted when a kernel is defined, so read the switch once, here.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

if HAS_TRITON:
    @triton.jit
    def await_previous_kernel(PDL: tl.constexpr):
        """First statement of every forward kernel. Launched with programmatic dependent launch
        (PDL), a kernel may start while the one before it on the stream is still running: wait
        here until that one has finished and its writes are visible (before touching any
        activation), then let the next kernel launch early in turn."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()


def runs_triton(t: torch.Tensor) -> bool:
    """True when ``t``'s device can run our Triton kernels in this process."""
    if not HAS_TRITON:
        return False
    if t.device.type == "cuda":
        return not TRITON_INTERPRET
    return t.device.type == "cpu" and TRITON_INTERPRET


def dependent_launch(device: torch.device, programs: int) -> bool:
    """Whether a launch of ``programs`` programs on ``device`` uses programmatic dependent launch:
    CUDA compute capability 9.0+ (Hopper), compiled Triton, not switched off with
    ``SNAC_FAST_PDL=0``, and a grid of at most a few programs per SM. A streaming decode is a
    chain of short single-wave kernels; PDL overlaps each one's launch with the end of the one
    before (H200, 24 kHz streaming chunk: graph replay 0.209 -> 0.200 ms). Long grids lose by it
    (60 s decode: 5.59 -> 6.10 ms with every kernel on PDL): their next kernel's waiting programs
    take SM slots from the last wave."""
    if device.type != "cuda" or TRITON_INTERPRET or os.environ.get("SNAC_FAST_PDL", "1") == "0":
        return False
    index = cuda_index(device)
    return programs <= 8 * _wave_programs(index) and _capability(index) >= (9, 0)


def through_op(*tensors: torch.Tensor | None) -> bool:
    """Whether a call must go through its registered ``torch.library`` op rather than the op's body:
    when torch.compile or export traces it, or autograd records it. Plain inference calls the body
    directly: an op's first call imports torch._dynamo and what it pulls in (sympy, distributed:
    about 850 modules, 1-5 s of a fresh process's first decode), and each call pays the
    dispatcher's ~15 us."""
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def device_scope(device: torch.device):
    """Make ``device`` current for a call (side streams, graphs, kernels), whichever CUDA device the
    caller has current; a no-op off CUDA."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def cuda_index(device: torch.device) -> int:
    """The ordinal of a CUDA ``device`` ("cuda" alone means the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def launch_flags(device: torch.device, programs: int) -> dict[str, bool]:
    """Keyword arguments for a forward kernel's launch: its PDL constexpr and Triton's launch_pdl."""
    pdl = dependent_launch(device, programs)
    return {"PDL": pdl, "launch_pdl": pdl}


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def wave_programs(device: torch.device) -> int:
    """How many programs a launch needs to occupy ``device``: its SM count rounded down to a power
    of two (128 on H100/H200). 1 for Triton's interpreter, which pays per program: biggest tiles."""
    if device.type != "cuda" or TRITON_INTERPRET:
        return 1
    return _wave_programs(cuda_index(device))


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
