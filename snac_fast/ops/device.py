"""Where kernels run: CUDA tensors use compiled Triton; CPU tensors use Triton's interpreter when
``TRITON_INTERPRET=1`` was set before import (how CI tests kernels), else the torch reference. The
device's limits the launch rules see (:class:`GpuLimits`, emulated for other cards by
:func:`emulate_gpu`), and the device scope of a call."""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from dataclasses import dataclass

import torch

try:  # Triton is a Linux-only dependency; without it every op takes its torch reference path.
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on platforms without Triton
    HAS_TRITON = False

# triton.jit decides compiled-vs-interpreted when a kernel is defined, so read the switch once, here.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

@dataclass(frozen=True)
class GpuLimits:
    """What the launch rules may assume of a CUDA device: its compute capability (TMA and dependent
    launch need 9.0), its SM count (tiles are chosen so that a launch fills the SMs) and the shared
    memory one block may use (the opt-in maximum, bytes)."""

    name: str
    capability: tuple[int, int]
    sms: int
    shared_memory: int

    def __post_init__(self) -> None:
        if self.sms < 1 or self.shared_memory < 1:
            raise ValueError(f"{self.name}: SM count and shared memory must be positive")


# The cards users decode on, by the limits the rules see (CUDA programming guide, compute
# capabilities table: 163 KB a block on sm_80, 99 KB on sm_86/sm_89, 227 KB on sm_90).
GPUS = {
    "a100": GpuLimits("A100 (sm_80)", (8, 0), 108, 166912),
    "a10g": GpuLimits("A10G (sm_86)", (8, 6), 80, 101376),
    "rtx3090": GpuLimits("RTX 3090 (sm_86)", (8, 6), 82, 101376),
    "l4": GpuLimits("L4 (sm_89)", (8, 9), 58, 101376),
    "rtx4090": GpuLimits("RTX 4090 (sm_89)", (8, 9), 128, 101376),
    "l40s": GpuLimits("L40S (sm_89)", (8, 9), 142, 101376),
    "h100": GpuLimits("H100 SXM (sm_90)", (9, 0), 132, 232448),
}

# SNAC_FAST_GPU_LIMITS=<name of GPUS>: run as if the device had no more than that card's limits
# (portable mode: on an H100, "rtx3090" gives sm_86's rules, no TMA, no dependent launch, 99 KB).
GPU_LIMITS_ENV = "SNAC_FAST_GPU_LIMITS"

_emulated: GpuLimits | None = None  # set by emulate_gpu: the rules pick that card's configurations


@contextlib.contextmanager
def emulate_gpu(limits: GpuLimits):
    """Within it, every launch rule chooses what it would on a device of ``limits`` whatever the
    tensors' device (how :mod:`snac_fast.targets` records a card's launches on a CPU machine)."""
    global _emulated
    previous, _emulated = _emulated, limits
    try:
        yield limits
    finally:
        _emulated = previous


def gpu_limits(device: torch.device) -> GpuLimits | None:
    """The limits the rules use for launches on ``device``: the emulated card's inside
    :func:`emulate_gpu`; None where kernels run in Triton's interpreter or not at all; else the CUDA
    device's own, capped by ``SNAC_FAST_GPU_LIMITS``."""
    if _emulated is not None:
        return _emulated
    if device.type != "cuda" or TRITON_INTERPRET:
        return None
    return _device_limits(cuda_index(device))


def interpreter_configs() -> bool:
    """Whether launch rules pick the interpreter's configurations (few, big programs: it pays per
    program), not a GPU's."""
    return TRITON_INTERPRET and _emulated is None


@functools.lru_cache(maxsize=None)
def _device_limits(index: int) -> GpuLimits:
    props = torch.cuda.get_device_properties(index)
    own = GpuLimits(props.name, (props.major, props.minor), props.multi_processor_count,
                    getattr(props, "shared_memory_per_block_optin", 0) or 101376)
    cap = os.environ.get(GPU_LIMITS_ENV, "").strip().lower()
    if not cap:
        return own
    if cap not in GPUS:
        raise ValueError(f"{GPU_LIMITS_ENV}={cap!r}: expected one of {', '.join(GPUS)}")
    other = GPUS[cap]
    return GpuLimits(f"{own.name} as {other.name}", min(own.capability, other.capability),
                     min(own.sms, other.sms), min(own.shared_memory, other.shared_memory))


MIN_CAPABILITY = (8, 0)  # Ampere: the oldest architecture the kernels are checked for (snac_fast.targets)


def runs_triton(t: torch.Tensor) -> bool:
    """True when ``t``'s device can run our Triton kernels in this process (CUDA: Ampere or later)."""
    if not HAS_TRITON:
        return False
    if t.device.type == "cuda":
        return not TRITON_INTERPRET and _supported(t.device.index if t.device.index is not None else 0)
    return t.device.type == "cpu" and TRITON_INTERPRET


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    """Whether CUDA device ``index`` is one the kernels are checked for; warns once if not."""
    capability = torch.cuda.get_device_capability(index)
    if capability >= MIN_CAPABILITY:
        return True
    warnings.warn(f"{torch.cuda.get_device_name(index)} (sm_{capability[0]}{capability[1]}) is older than Ampere: "
                  "snac-fast runs its torch reference path there (upstream's speed)", RuntimeWarning, stacklevel=3)
    return False


def through_op(*tensors: torch.Tensor | None) -> bool:
    """Whether a call must go through its registered ``torch.library`` op rather than the op's body:
    when torch.compile or export traces it, or autograd records it. Plain inference calls the body
    directly: an op's first call imports torch._dynamo and what it pulls in (sympy, distributed:
    about 850 modules, seconds of a fresh process's first decode), and each call pays the
    dispatcher's overhead (docs/measurements.md)."""
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def device_scope(device: torch.device):
    """Make ``device`` current for a call (side streams, graphs, kernels), whichever CUDA device the
    caller has current; a no-op off CUDA, for "cuda" without an index (the current device), and
    where it is current already (entering and leaving torch.cuda.device costs a stream step several
    microseconds of host time)."""
    if device.type != "cuda" or device.index is None or torch.cuda.current_device() == device.index:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def make_current(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device for good (a thread that works only
    on it: :func:`device_scope` is then a no-op); nothing off CUDA or for "cuda" without an index."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


@contextlib.contextmanager
def true_float32():
    """Run convolutions and matmuls in real float32 (no TF32) inside the block."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def exact_float32_cudnn(x: torch.Tensor):
    """A context for a cuDNN call on ``x``: float32 on CUDA runs in real float32 (cuDNN's TF32,
    PyTorch's default, costs a float32 decode about 50 dB against upstream; docs/measurements.md);
    other dtypes and devices, and traced calls (the compiler picks its own convs), are untouched."""
    if x.dtype != torch.float32 or not x.is_cuda or torch.compiler.is_compiling() or not torch.backends.cudnn.allow_tf32:
        return contextlib.nullcontext()
    return true_float32()


def cuda_index(device: torch.device) -> int:
    """The ordinal of a CUDA ``device`` ("cuda" alone means the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()
