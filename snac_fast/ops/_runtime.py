"""Where kernels run: CUDA tensors use compiled Triton; CPU tensors use Triton's interpreter when
``TRITON_INTERPRET=1`` was set before import (how CI tests kernels), else the torch reference."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading

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


_runtime_warmup: list[threading.Thread] = []
_runtime_warmup_lock = threading.Lock()


def start_runtime_warmup(device: torch.device) -> None:
    """Once per process, on two background threads while the caller builds a model on the CPU:
    start CUDA on ``device`` (its context, 0.1 s, and cuDNN's libraries and handle, which the
    transposed convs' first call would load: 0.07 s; H100 host), and compute Triton's cache key
    (``triton_key``, a sha256 of its ~400 MB compiler library that the first kernel launch of a
    process needs to find its compiled kernels: 0.35-1.1 s depending on the CPU). Both release the
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
    before (H200, 24 kHz streaming chunk: graph replay 0.209 -> 0.200 ms). Long grids lose by it
    (60 s decode: 5.59 -> 6.10 ms with every kernel on PDL): their next kernel's waiting programs
    take SM slots from the last wave."""
    if device.type != "cuda" or TRITON_INTERPRET or os.environ.get("SNAC_FAST_PDL", "1") == "0":
        return False
    index = cuda_index(device)
    return programs <= 8 * _wave_programs(index) and _capability(index) >= (9, 0)


def has_tma(device: torch.device) -> bool:
    """Whether compiled Triton kernels on ``device`` can move tiles with the Tensor Memory
    Accelerator (CUDA compute capability 9.0+: Hopper and later)."""
    return device.type == "cuda" and not TRITON_INTERPRET and HAS_TRITON and _capability(cuda_index(device)) >= (9, 0)


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
    caller has current; a no-op off CUDA, for "cuda" without an index (the current device), and
    where it is current already (entering and leaving torch.cuda.device costs a stream step several
    microseconds of host time)."""
    if device.type != "cuda" or device.index is None or torch.cuda.current_device() == device.index:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


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
