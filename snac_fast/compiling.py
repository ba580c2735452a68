"""Compile Triton kernels concurrently, before their first launch.

A fresh process compiles each kernel variant the first time it is launched, one after another:
about 30 variants for a 24 kHz decode, 25 s on an H100 host. Inside :func:`compiling_concurrently`
the calling thread's launches compile without running (Triton's ``AsyncCompileMode``), so one pass
over a decode's shapes hands every variant to a thread pool at once, and each job also builds its
kernel's C launcher (a gcc run per kernel signature that Triton would otherwise do at the first
launch). Triton's front end holds the GIL, but its LLVM passes, ptxas and gcc run in parallel:
30 variants compile in 5.6 s on 16 threads (H100 host, 2026-11-22). Worker processes were tried
and lost (8.6 s): each must import torch to reach the kernels, and the cache keys they wrote did
not always match the parent's.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

from snac_fast.ops._runtime import HAS_TRITON, TRITON_INTERPRET

_patch_lock = threading.Lock()
_patch_users = 0  # threads inside compiling_concurrently(): the launch patch stays while any is
_unpatched_run = None
_this_thread = threading.local()


def _run_or_compile_only(self, *args, grid, warmup, **kwargs):
    compile_only = warmup or getattr(_this_thread, "compile_only", False)
    return _unpatched_run(self, *args, grid=grid, warmup=compile_only, **kwargs)


@contextlib.contextmanager
def compiling_concurrently(workers: int | None = None) -> Iterator[None]:
    """Inside: this thread's Triton launches compile (concurrently, on ``workers`` threads, default
    one per CPU up to 16) and return without running; all are compiled when the block exits.
    Torch ops still run, on whatever the skipped kernels left in memory: use it for a pass whose
    shapes, not values, matter. The launch patch is process-wide but acts on the entering thread
    only: other threads (a server already decoding) launch as usual. A no-op without compiled
    Triton."""
    global _patch_users, _unpatched_run
    if not HAS_TRITON or TRITON_INTERPRET or getattr(_this_thread, "compile_only", False):
        yield
        return
    from triton.runtime._async_compile import AsyncCompileMode
    from triton.runtime.jit import JITFunction

    with _patch_lock:
        if _patch_users == 0:
            _unpatched_run, JITFunction.run = JITFunction.run, _run_or_compile_only
        _patch_users += 1
    _this_thread.compile_only = True
    try:
        with _CompileAndBuildLauncher(workers or min(16, os.cpu_count() or 1)) as pool, AsyncCompileMode(pool):
            yield
    finally:
        _this_thread.compile_only = False
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                JITFunction.run = _unpatched_run


class _CompileAndBuildLauncher(ThreadPoolExecutor):
    """A thread pool whose compile jobs also build their kernel's C launcher (cached in Triton's
    cache; the first launch loads it): 13 launchers, 4.5 s of a 24 kHz decode's cold start when
    built one by one (H100 host)."""

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(_compiled_with_launcher, fn, *args, **kwargs)


def _compiled_with_launcher(compile_fn, *args, **kwargs):
    from triton.runtime.driver import driver

    kernel = compile_fn(*args, **kwargs)
    launcher = getattr(driver.active, "launcher_cls", None)
    if launcher is not None:
        launcher(kernel.src, kernel.metadata)
    return kernel
