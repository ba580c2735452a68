"""Compile Triton kernels concurrently, before their first launch.

A fresh process compiles each kernel variant the first time it is launched, one after another:
about 30 variants for a 24 kHz decode, tens of seconds (docs/measurements.md). Inside :func:`compiling_concurrently`
the calling thread's launches compile without running (Triton's ``AsyncCompileMode``), so one pass
over a decode's shapes hands every variant to a thread pool at once, and each job also builds its
kernel's C launcher (a gcc run per kernel signature that Triton would otherwise do at the first
launch). Triton's front end holds the GIL, so on Linux each job compiles in a forked child process
(a copy of this one: the same kernels, options and cache keys, no imports) that writes Triton's
persistent cache, and the job then loads the result from there. Worker processes started afresh
were tried and lost: each must import torch to reach the kernels, and the cache keys they wrote
did not always match the parent's. ``SNAC_FAST_COMPILE_FORK=0`` compiles on the threads instead.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

from snac_fast.ops.device import HAS_TRITON, TRITON_INTERPRET

# a forked child runs only the compiler (no CUDA, no locks of other threads); Python 3.12 warns on
# any fork of a multi-threaded process
warnings.filterwarnings("ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning,
                        module=r"snac_fast\.compiling")
COMPILE_IN_FORKS = sys.platform == "linux" and os.environ.get("SNAC_FAST_COMPILE_FORK", "1") != "0"
FORK_TIMEOUT_S = 120.0  # a child past this is killed and its kernel compiled in this process

_patch_lock = threading.Lock()
_patch_users = 0  # threads inside compiling_concurrently(): the launch patch stays while any is
_unpatched_run = None
_this_thread = threading.local()
_unpatched_cache_manager: dict = {}
# one fork at a time: filelock (imported by huggingface_hub and torch's Inductor) vetoes an os.fork
# made while another thread of the process is inside one ("os.fork is unsafe while filelock is ...")
_fork_lock = threading.Lock()
_launchers_lock = threading.Lock()
_launchers_built: set = set()  # launcher sources built (or being built) by this process


class _CacheMiss(Exception):
    """Raised by a probing thread's cache lookup where Triton would start compiling."""


def _probing_cache_manager(key):
    """Triton's cache manager for one kernel key; on a thread that probes, a lookup that finds no
    compiled kernel raises :class:`_CacheMiss` instead of letting ``triton.compile`` go on."""
    manager = _unpatched_cache_manager["get"](key)
    if getattr(_this_thread, "probe", False):
        get_group = manager.get_group

        def probe(filename):
            group = get_group(filename)
            if not group or filename not in group:
                raise _CacheMiss(filename)
            return group
        manager.get_group = probe
    return manager


def _run_or_compile_only(self, *args, grid, warmup, **kwargs):
    compile_only = warmup or getattr(_this_thread, "compile_only", False)
    return _unpatched_run(self, *args, grid=grid, warmup=compile_only, **kwargs)


@contextlib.contextmanager
def compiling_concurrently(workers: int | None = None) -> Iterator[list[str]]:
    """Inside: this thread's Triton launches compile (concurrently, on ``workers`` threads, default
    one per CPU up to 16) and return without running; all are compiled when the block exits.
    Torch ops still run, on whatever the skipped kernels left in memory: use it for a pass whose
    shapes, not values, matter. The launch patch is process-wide but acts on the entering thread
    only: other threads (a server already decoding) launch as usual. Yields a list that holds, once
    the block exits, the Triton cache files of every kernel the block compiled or loaded (empty
    when nested in another such block, whose list gets them). A no-op without compiled Triton."""
    global _patch_users, _unpatched_run
    if not HAS_TRITON or TRITON_INTERPRET or getattr(_this_thread, "compile_only", False):
        yield []
        return
    from triton.compiler import compiler
    from triton.runtime.jit import JITFunction

    with _patch_lock:
        if _patch_users == 0:
            _unpatched_run, JITFunction.run = JITFunction.run, _run_or_compile_only
            _unpatched_cache_manager["get"], compiler.get_cache_manager = compiler.get_cache_manager, _probing_cache_manager
        _patch_users += 1
    _this_thread.compile_only = True
    try:
        with _CompileAndBuildLauncher(workers or min(16, os.cpu_count() or 1)) as pool, _async_compile_mode(pool):
            yield pool.cached_files
    finally:
        _this_thread.compile_only = False
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                JITFunction.run = _unpatched_run
                compiler.get_cache_manager = _unpatched_cache_manager.pop("get")


@contextlib.contextmanager
def _async_compile_mode(pool) -> Iterator[None]:
    """Triton's AsyncCompileMode on ``pool``; at the exit every compile is waited for and the first
    failure raised. Triton raises it before it clears its active mode, which then stayed set: every
    later compiling_concurrently() of the thread failed with 'Another AsyncCompileMode is already
    active' and the compile error was lost. Here the mode is cleared whatever happens."""
    from triton.runtime._async_compile import AsyncCompileMode, active_mode

    mode = AsyncCompileMode(pool)
    try:
        with mode:
            yield
    finally:
        if active_mode.get() is mode:
            active_mode.set(None)


class _CompileAndBuildLauncher(ThreadPoolExecutor):
    """A thread pool whose compile jobs also build their kernel's C launcher (cached in Triton's
    cache; the first launch loads it): built one by one, a 24 kHz decode's 13 launchers took seconds
    of its cold start. With :data:`COMPILE_IN_FORKS` the compilation runs in a child and the
    launcher is built here, once per launcher source (kernels of one signature share it)."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.cached_files: list[str] = []  # every compiled kernel's files in Triton's cache

    def submit(self, fn, /, *args, **kwargs):
        job = _compiled_in_child if COMPILE_IN_FORKS else _compiled_with_launcher
        return super().submit(self._recorded, job, fn, *args, **kwargs)

    def _recorded(self, job, *args, **kwargs):
        kernel = job(*args, **kwargs)
        self.cached_files.extend(getattr(kernel, "metadata_group", {}).values())
        return kernel


def _compiled_with_launcher(compile_fn, *args, **kwargs):
    from triton.runtime.driver import driver

    kernel = compile_fn(*args, **kwargs)
    launcher = getattr(driver.active, "launcher_cls", None)
    if launcher is not None and _first_with_launcher_of(kernel):
        launcher(kernel.src, kernel.metadata)
    return kernel


def _first_with_launcher_of(kernel) -> bool:
    """Whether ``kernel`` is the first of this process whose C launcher is built here. A launcher's
    source depends only on the kernel's argument types (and TMA descriptors): a 256-stream warm-up's
    161 kernels share 19. Built in every compile job, concurrent jobs of one signature all missed
    the cache and ran gcc (docs/cold_start.md). A kernel skipped here loads
    its launcher from the cache at its first launch (or builds it then, should this build fail)."""
    signature = getattr(kernel.src, "signature", None)
    if not isinstance(signature, dict):
        return True
    key = (tuple(signature.values()), repr(getattr(kernel.metadata, "tensordesc_meta", None)))
    with _launchers_lock:
        if key in _launchers_built:
            return False
        _launchers_built.add(key)
        return True


def _compiled_in_child(compile_fn, *args, **kwargs):
    """A kernel already in Triton's cache loads here. Else a forked child compiles it, writes the
    kernel to the cache and exits without cleanup, and this thread loads it from there and builds
    its launcher. Should the child fail or hang, this process compiles the kernel itself and reports
    any error as Triton would."""
    _this_thread.probe = True
    try:
        return _compiled_with_launcher(compile_fn, *args, **kwargs)
    except _CacheMiss:
        pass
    finally:
        _this_thread.probe = False
    try:
        with _fork_lock:
            pid = os.fork()
    except RuntimeError:  # a fork vetoed by an audit hook (filelock's, while another thread forks): compile here
        return _compiled_with_launcher(compile_fn, *args, **kwargs)
    if pid == 0:
        # no cycle collection here: a dead cycle holding a CUDA or pinned tensor would free it through a
        # CUDA context the child cannot use (an abort, and the parent compiling the kernel again itself)
        gc.disable()
        status = 1
        try:
            compile_fn(*args, **kwargs)  # the launcher is built by the parent, once per source
            status = 0
        except BaseException:  # the parent recompiles and raises the error where it can be seen
            pass
        os._exit(status)
    deadline = time.monotonic() + FORK_TIMEOUT_S
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.005)
    return _compiled_with_launcher(compile_fn, *args, **kwargs)
