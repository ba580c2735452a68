"""A process's first CUDA and Triton work, started early on background threads (a model's load
overlaps it): the CUDA context and cuDNN's handle, and Triton's cache key, kept beside the kernels."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading

import torch

from snac_fast.ops.device import HAS_TRITON, TRITON_INTERPRET

warmup_threads: list[threading.Thread] = []
_warmup_lock = threading.Lock()


def start_runtime_warmup(device: torch.device) -> None:
    """Once per process, on two background threads while the caller builds a model on the CPU:
    start CUDA on ``device`` (its context, and cuDNN's libraries and handle, which the transposed
    convs' first call would load), and compute Triton's cache key (``triton_key``, a sha256 of its
    ~400 MB compiler library that the first kernel launch of a process needs to find its compiled
    kernels: up to a second; docs/measurements.md). Both release the
    GIL. :func:`finish_runtime_warmup` waits for them. A no-op off CUDA."""
    if device.type != "cuda" or not HAS_TRITON or TRITON_INTERPRET:
        return
    with _warmup_lock:
        if not warmup_threads:
            for target in (functools.partial(_start_cuda, device), cache_triton_key):
                thread = threading.Thread(target=_quietly, args=(target,), name="snac-fast warm-up", daemon=True)
                thread.start()
                warmup_threads.append(thread)


def _start_cuda(device: torch.device) -> None:
    torch.cuda.init()
    with torch.cuda.device(device):
        tiny = torch.zeros((1, 1, 2), device=device, dtype=torch.float16)
        # cuDNN's handle goes back to torch's pool when this thread ends: the caller's thread takes it
        torch.nn.functional.conv_transpose1d(tiny, tiny)
        torch.cuda.synchronize()


TRITON_KEY_FILE = "snac_fastcache_triton_key.json"


def cache_triton_key() -> None:
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
    for thread in list(warmup_threads):
        thread.join()
