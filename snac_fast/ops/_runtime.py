"""Where kernels run: CUDA tensors use compiled Triton; CPU tensors use Triton's interpreter when
``TRITON_INTERPRET=1`` was set before import (how CI tests kernels), else the torch reference."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

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


_runtime_warmup: list[threading.Thread] = []
_runtime_warmup_lock = threading.Lock()


def start_runtime_warmup(device: torch.device) -> None:
    """Once per process, on two background threads while the caller builds a model on the CPU:
    start CUDA on ``device`` (its context, and cuDNN's libraries and handle, which the transposed
    convs' first call would load), and compute Triton's cache key (``triton_key``, a sha256 of its
    ~400 MB compiler library that the first kernel launch of a process needs to find its compiled
    kernels: up to a second; docs/measurements.md). Both release the
    GIL. :func:`finish_runtime_warmup` waits for them. A no-op off CUDA."""
    if device.type != "cuda" or not HAS_TRITON or TRITON_INTERPRET:
        return
    with _runtime_warmup_lock:
        if not _runtime_warmup:
            for target in (functools.partial(_start_cuda, device), _triton_key):
                thread = threading.Thread(target=_quietly, args=(target,), name="snac-fast warm-up", daemon=True)
                thread.start()
                _runtime_warmup.append(thread)


def _start_cuda(device: torch.device) -> None:
    torch.cuda.init()
    with torch.cuda.device(device):
        tiny = torch.zeros((1, 1, 2), device=device, dtype=torch.float16)
        # cuDNN's handle goes back to torch's pool when this thread ends: the caller's thread takes it
        torch.nn.functional.conv_transpose1d(tiny, tiny)
        torch.cuda.synchronize()


TRITON_KEY_FILE = "snac_fast_triton_key.json"


def _triton_key() -> None:
    """Make ``triton.runtime.cache.triton_key`` (what the launch path calls) return at once: its
    value is kept in the Triton cache directory beside the kernels, valid while every file it
    hashes has the size, mtime and inode it had (as Python validates .pyc files); else it is
    computed as Triton does and stored."""
    from triton import knobs
    from triton.runtime import cache

    stamp = _triton_files_stamp(os.path.dirname(os.path.dirname(os.path.abspath(cache.__file__))))
    path = os.path.join(knobs.cache.dir, TRITON_KEY_FILE)
    try:
        with open(path) as f:
            stored = json.load(f)
        if stored.get("stamp") == stamp and isinstance(stored.get("key"), str):
            key = stored["key"]
            cache.triton_key = lambda: key
            return
    except (OSError, ValueError):
        pass
    key = cache.triton_key()  # functools.lru_cache: the launch path reuses it
    os.makedirs(knobs.cache.dir, exist_ok=True)
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "w") as f:
        json.dump({"stamp": stamp, "key": key}, f)
    os.replace(partial, path)


def _triton_files_stamp(root: str) -> str:
    """sha256 over (path, size, mtime, inode) of every file triton_key hashes (a superset: all of
    compiler/, backends/, language/, runtime/cache.py and the compiler library)."""
    entries = []
    for folder in ("compiler", "backends", "language", "_C"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, folder)):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith((".py", ".so")):
                    entries.append(os.path.join(dirpath, name))
    entries.append(os.path.join(root, "runtime", "cache.py"))
    digest = hashlib.sha256()
    for entry in entries:
        st = os.stat(entry)
        digest.update(f"{entry}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n".encode())
    return digest.hexdigest()


def _quietly(target) -> None:
    try:
        target()
    except Exception:  # an internal of Triton that moved, or no usable GPU: the first launch does it, as before
        pass


def finish_runtime_warmup() -> None:
    """Wait for :func:`start_runtime_warmup`'s threads, so that no launch computes the key a second time."""
    for thread in list(_runtime_warmup):
        thread.join()


def dependent_launch(device: torch.device, programs: int) -> bool:
    """Whether a launch of ``programs`` programs on ``device`` uses programmatic dependent launch:
    CUDA compute capability 9.0+ (Hopper), compiled Triton, not switched off with
    ``SNAC_FAST_PDL=0``, and a grid of at most a few programs per SM. A streaming decode is a
    chain of short single-wave kernels; PDL overlaps each one's launch with the end of the one
    before. Long grids lose by it: their next kernel's waiting programs take SM slots from the last
    wave (both measured: docs/measurements.md). The bound is 8 waves (:func:`wave_programs`)."""
    limits = gpu_limits(device)
    if limits is None or os.environ.get("SNAC_FAST_PDL", "1") == "0":
        return False
    return programs <= 8 * wave_programs(device) and limits.capability >= (9, 0)


def has_tma(device: torch.device) -> bool:
    """Whether compiled Triton kernels on ``device`` can move tiles with the Tensor Memory
    Accelerator (CUDA compute capability 9.0+: Hopper and later)."""
    limits = gpu_limits(device)
    return HAS_TRITON and limits is not None and limits.capability >= (9, 0)


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


def launch_flags(device: torch.device, programs: int, pdl: bool | None = None) -> dict[str, bool]:
    """Keyword arguments for a forward kernel's launch: its PDL constexpr and Triton's launch_pdl
    (``pdl``: a choice made already, such as a recorded one)."""
    pdl = dependent_launch(device, programs) if pdl is None else pdl
    return {"PDL": pdl, "launch_pdl": pdl}


_rows_per_tile_choice = contextvars.ContextVar("rows_per_tile_choice", default=1)


@contextlib.contextmanager
def tiles_as_for_fewer_rows(factor: int):
    """Inside, the launch rules choose tiles (and dependent launch) as for a launch ``factor`` times
    smaller: the programs a launch must fill the GPU with, and the bound on dependent launches, scale
    by it. A stream engine's steps of 2-8 rows take the 1-row step's tiles this way, so warming them
    compiles no kernel variants of their own (docs/cold_start.md)."""
    token = _rows_per_tile_choice.set(max(1, int(factor)))
    try:
        yield
    finally:
        _rows_per_tile_choice.reset(token)


_recorded_launches = contextvars.ContextVar("recorded_launches", default=None)


@contextlib.contextmanager
def launches_as_recorded(memo: dict, record: bool):
    """Inside, each launcher that asks :func:`launch_choice` takes the choice ``memo`` holds for its
    key (its tiles, warps, dependent launch), and with ``record`` adds the choices it makes. A
    stream engine records its one-frame step's launches per batch bucket and runs that bucket's
    prefill and flush with them: their lengths differ from the step's, and choices of their own would
    be kernel variants of their own, a third more compiles at a cold start (docs/cold_start.md)."""
    token = _recorded_launches.set((memo, record))
    try:
        yield
    finally:
        _recorded_launches.reset(token)


def launch_choice(key: tuple, choose: Callable[[], object], fits: Callable[[object], bool] = lambda choice: True):
    """``choose()``, or inside :func:`launches_as_recorded` the choice recorded under ``key`` where
    ``fits(choice)`` says it is valid for this launch (the key names a layer's launch: everything the
    choice depends on but the length and alignment). Recording launches keep their own choices:
    where two share a key, the first one's is recorded."""
    scope = _recorded_launches.get()
    if scope is None or interpreter_configs():  # the interpreter compiles nothing: its own big tiles
        return choose()
    memo, record = scope
    if record:
        choice = choose()
        memo.setdefault(key, choice)
        return choice
    return memo[key] if key in memo and fits(memo[key]) else choose()


def wave_programs(device: torch.device) -> int:
    """How many programs a launch needs to occupy ``device``: its SM count rounded down to a power
    of two (128 on H100/H200), times :func:`tiles_as_for_fewer_rows`' factor. 1 for Triton's
    interpreter, which pays per program: biggest tiles."""
    limits = gpu_limits(device)
    return 1 if limits is None else _power_of_two_below(limits.sms) * _rows_per_tile_choice.get()


def _power_of_two_below(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def first_filling(tiles: list[tuple[int, ...]], programs, target: int) -> tuple[int, ...]:
    """The first tile (in order of preference, biggest first) whose launch has at least ``target``
    programs, else the last. Small problems get small tiles so that every SM works: at streaming
    sizes a decoder kernel is latency-bound, not bandwidth-bound (scripts/tune_tiles.py)."""
    for tile in tiles:
        if programs(tile) >= target:
            return tile
    return tiles[-1]


GemmConfig = tuple[int, int, int, int, int]  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
_fitted: dict[tuple, GemmConfig] = {}


def smaller_gemm_config(config: GemmConfig) -> GemmConfig | None:
    """The next configuration to try when one does not fit: one pipeline stage fewer, then half the
    K step, then half the column tile (shared memory is stages x (BLOCK_M + BLOCK_N) x BLOCK_K)."""
    block_m, block_n, block_k, warps, stages = config
    if stages > 1:
        return block_m, block_n, block_k, warps, stages - 1
    if block_k > 16:
        return block_m, block_n, block_k // 2, warps, stages
    if block_n > 16:
        return block_m, block_n // 2, block_k, warps, stages
    return None


def launch_fitting(key: tuple, config: GemmConfig, launch: Callable[[GemmConfig], object]):
    """``launch(config)``; where the device refuses it for its resources (Triton's OutOfResources:
    the shared memory or registers of a card the rules did not foresee), the first of
    :func:`smaller_gemm_config`'s configurations that launches, remembered per ``key`` and config
    (one warning each) so later calls go straight to it."""
    from triton.runtime.errors import OutOfResources

    fitted = _fitted.get((key, config), config)
    while True:
        try:
            return launch(fitted)
        except OutOfResources as error:
            smaller = smaller_gemm_config(fitted)
            if smaller is None:
                raise
            if (key, config) not in _fitted:
                warnings.warn(f"{key[0]}: configuration {config} does not fit this GPU ({error}); "
                              "using smaller ones", RuntimeWarning, stacklevel=3)
            fitted = _fitted[(key, config)] = smaller
