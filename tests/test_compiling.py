"""snac_fast.runtime.compiling: Triton kernels compiled concurrently, cache misses compiled in forked
children, launchers built once, the probing cache lookup, and the async-compile mode's clean-up."""

import contextlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest


def test_compile_only_launches_stay_in_the_entering_thread(monkeypatch):
    """compiling_concurrently() turns launches into compile-only warm-ups for its own thread only,
    while other threads (a server decoding) launch as usual; overlapping blocks in two threads put
    Triton's launch back as it was."""
    from triton.compiler import compiler
    from triton.runtime.jit import JITFunction

    import snac_fast.runtime.compiling as compiling

    seen = []
    original_manager = compiler.get_cache_manager
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kw: seen.append((self, warmup)))
    original = JITFunction.run
    monkeypatch.setattr(compiling, "TRITON_INTERPRET", False)  # the patch logic, without a GPU
    inside, leave = threading.Barrier(3), threading.Event()

    def compile_pass(name):
        with compiling.compiling_concurrently(workers=1):
            JITFunction.run(name, grid=(1,), warmup=False)
            inside.wait()
            leave.wait()

    threads = [threading.Thread(target=compile_pass, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    inside.wait()  # both blocks are open
    JITFunction.run("server", grid=(1,), warmup=False)
    leave.set()
    for t in threads:
        t.join()
    assert sorted(seen) == [("a", True), ("b", True), ("server", False)]
    assert JITFunction.run is original
    assert compiler.get_cache_manager is original_manager


def test_cache_misses_compile_in_a_forked_child(monkeypatch, tmp_path):
    """A compile job loads a cached kernel in this process; a missing one is compiled by a forked
    child (writing the cache) and then loaded here; a child that fails leaves the compilation and
    its error to this process."""
    import snac_fast.runtime.compiling as compiling

    calls = []

    def compile_kernel(path, fail=False):  # stands in for Triton's compile: a cache file per kernel
        probing = getattr(compiling._this_thread, "probe", False)
        calls.append(probing)
        if not path.exists():
            if probing:
                raise compiling._CacheMiss(path.name)
            if fail:
                raise RuntimeError("ptxas failed")
            path.write_text(str(os.getpid()))
        return path.read_text()

    monkeypatch.setattr(compiling, "_compiled_with_launcher", lambda fn, *args, **kw: fn(*args, **kw))
    kernel = tmp_path / "kernel"
    compiled_by = compiling._compiled_in_child(compile_kernel, kernel)
    assert compiled_by != str(os.getpid())  # the child wrote it
    assert calls == [True, False]  # here: the probe missed, then the load hit (the child's call is its own)
    calls.clear()
    assert compiling._compiled_in_child(compile_kernel, kernel) == compiled_by
    assert calls == [True]  # cached: no child
    with pytest.raises(RuntimeError, match="ptxas failed"):
        compiling._compiled_in_child(compile_kernel, tmp_path / "broken", fail=True)


def test_concurrent_compile_jobs_fork_one_at_a_time(monkeypatch, tmp_path):
    """filelock (imported by huggingface_hub and Inductor) vetoes an os.fork made while another
    thread is inside one: the jobs of the pool fork one at a time, so every kernel still compiles
    in a child; a vetoed fork compiles the kernel in this process instead of failing the job."""
    import snac_fast.runtime.compiling as compiling

    inside, guard, real_fork = [0], threading.Lock(), os.fork

    def vetoing_fork():  # filelock's audit hook, with a fork slow enough for threads to collide
        with guard:
            if inside[0]:
                raise RuntimeError("os.fork is unsafe while filelock is changing descriptor ownership")
            inside[0] += 1
        try:
            time.sleep(0.02)
            return real_fork()
        finally:
            with guard:
                inside[0] -= 1

    def compile_kernel(path):
        if not path.exists():
            if getattr(compiling._this_thread, "probe", False):
                raise compiling._CacheMiss(path.name)
            path.write_text(str(os.getpid()))
        return path.read_text()

    monkeypatch.setattr(compiling, "_compiled_with_launcher", lambda fn, *args, **kw: fn(*args, **kw))
    monkeypatch.setattr(compiling.os, "fork", vetoing_fork)
    with ThreadPoolExecutor(6) as pool:
        compiled_by = list(pool.map(lambda i: compiling._compiled_in_child(compile_kernel, tmp_path / f"k{i}"), range(12)))
    assert str(os.getpid()) not in compiled_by  # no fork was vetoed
    monkeypatch.setattr(compiling, "_fork_lock", contextlib.nullcontext())
    inside[0] = 1  # another thread is inside a fork: this one's is vetoed
    assert compiling._compiled_in_child(compile_kernel, tmp_path / "vetoed") == str(os.getpid())


def test_compile_jobs_build_each_launcher_source_once(monkeypatch):
    """A C launcher (a gcc run) is built for the first kernel of each argument signature only, however
    many compile jobs of that signature finish at once; the kernels of a new signature get theirs."""
    from types import SimpleNamespace

    from triton.runtime.driver import driver

    import snac_fast.runtime.compiling as compiling

    built, guard = [], threading.Lock()

    class Launcher:  # Triton's CudaLauncher: builds (or loads) the launcher of a kernel's signature
        def __init__(self, src, metadata):
            time.sleep(0.01)  # a build slow enough for the other jobs to finish their kernels meanwhile
            with guard:
                built.append((tuple(src.signature.values()), metadata.tensordesc_meta))

    def kernel(i):
        signature = {"x": "*fp16", "n": "i32" if i % 3 else "constexpr"}
        return SimpleNamespace(src=SimpleNamespace(signature=signature), metadata=SimpleNamespace(tensordesc_meta=i % 2 or None))

    monkeypatch.setattr(driver, "_active", SimpleNamespace(launcher_cls=Launcher))
    monkeypatch.setattr(compiling, "_launchers_built", set())
    kernels = [kernel(i) for i in range(24)]
    with ThreadPoolExecutor(8) as pool:
        compiled = list(pool.map(lambda k: compiling._compiled_with_launcher(lambda: k), kernels))
    assert compiled == kernels
    expected = {(tuple(k.src.signature.values()), k.metadata.tensordesc_meta) for k in kernels}
    assert sorted(built, key=repr) == sorted(expected, key=repr)  # each once: 4 of 24


def test_probing_cache_lookup_raises_on_a_miss_only_where_asked(monkeypatch):
    import snac_fast.runtime.compiling as compiling

    class Manager:  # Triton's FileCacheManager: get_group(filename) -> {filename: path, ...} or None
        def __init__(self, key):
            self.key = key

        def get_group(self, filename):
            return {filename: "/cache/" + filename} if self.key == "hit" else None

    monkeypatch.setitem(compiling._unpatched_cache_manager, "get", Manager)
    assert compiling._probing_cache_manager("miss").get_group("k.json") is None  # other threads compile as usual
    compiling._this_thread.probe = True
    try:
        assert compiling._probing_cache_manager("hit").get_group("k.json") == {"k.json": "/cache/k.json"}
        with pytest.raises(compiling._CacheMiss):
            compiling._probing_cache_manager("miss").get_group("k.json")
    finally:
        compiling._this_thread.probe = False


def test_failed_compile_clears_async_compile_mode():
    """A compile that fails inside compiling_concurrently() raises its own error, and the thread
    can compile concurrently again (Triton's AsyncCompileMode left itself active on such a failure,
    and every later warm-up then failed with 'Another AsyncCompileMode is already active')."""
    from triton.runtime._async_compile import active_mode

    import snac_fast.runtime.compiling as compiling

    def failing_compile():
        raise RuntimeError("the compiler's own error")

    with ThreadPoolExecutor(1) as pool:
        with pytest.raises(RuntimeError, match="compiler's own error"):
            with compiling._async_compile_mode(pool):
                active_mode.get().submit("kernel", failing_compile, lambda kernel: None)
        assert active_mode.get() is None
        with compiling._async_compile_mode(pool):
            assert active_mode.get() is not None
    assert active_mode.get() is None
