"""Server contexts: building and decoding under inference_mode / no_grad, threads sharing one codec,
the caller's CUDA stream, GPU out-of-memory during graph capture."""

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers import NARROW, assert_matches_upstream_fp32, random_codes
from snac_fast import FastSNAC
from snac_fast.metrics import snr_db
from snac_fast.noise import decode_with_keyed_noise
from snac_fast.configs import published_config
from snac_fast.synthetic import make_checkpoint, synthetic_model


def test_build_and_decode_inside_inference_mode_and_no_grad(tmp_path):
    folder = make_checkpoint(tmp_path, "snac_24khz", **NARROW)  # loading, surgery and decode; widths do not matter
    codes = random_codes(published_config("snac_24khz"), 1, seed=3)
    plain = FastSNAC.from_pretrained(str(folder), device="cpu")
    expected = plain.decode(codes, seed=5)
    assert_matches_upstream_fp32(decode_with_keyed_noise(plain.reference_model(), codes, 5), expected)
    with torch.inference_mode():
        built = FastSNAC.from_pretrained(str(folder), device="cpu")
        wrapped = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu")  # an upstream model made in inference mode
        inside = built.decode(codes, seed=5)
    assert not any(p.is_inference() for p in built.model.parameters())
    assert torch.equal(inside, expected)
    with torch.no_grad():
        assert torch.equal(wrapped.decode(codes, seed=5), expected)
    assert torch.equal(built.decode(codes, seed=5), expected)  # and afterwards, outside inference mode


def _decode_in_threads(codec, jobs, threads=4):
    results, errors = {}, []

    def work(i):
        try:
            for j, (codes, seed) in enumerate(jobs):
                if j % threads == i:
                    results[j] = codec.decode(codes, seed=seed)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors, errors
    return [results[j] for j in range(len(jobs))]


def test_threads_share_one_codec():
    """Decodes from several threads at once patch the same NoiseBlocks: each must get its own seed's audio."""
    codec = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu", fuse=False)
    jobs = [(random_codes(codec.config, 1 + j % 3, seed=j), 100 + j) for j in range(8)]
    expected = [codec.decode(codes, seed=seed) for codes, seed in jobs]
    reference = codec.reference_model()
    for (codes, seed), want in zip(jobs[:2], expected):  # the single-thread decodes are upstream's
        assert_matches_upstream_fp32(decode_with_keyed_noise(reference, codes, seed), want)
    for got, want in zip(_decode_in_threads(codec, jobs), expected):
        assert torch.equal(got, want)


def test_inference_keeps_torch_compiler_stack_unloaded():
    """A fresh process's decode calls the kernels directly, not through their torch.library ops: a
    registered op's first call imports torch._dynamo (850 modules, seconds of a cold start)."""
    script = textwrap.dedent("""
        import sys, torch
        from helpers import NARROW, random_codes
        from snac_fast import FastSNAC
        from snac_fast.synthetic import synthetic_model
        codec = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu")
        codec.decode(random_codes(codec.config, 1), seed=0)
        print("dynamo" if "torch._dynamo" in sys.modules else "clean")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "clean"


def test_compile_only_launches_stay_in_the_entering_thread(monkeypatch):
    """compiling_concurrently() turns launches into compile-only warm-ups for its own thread only,
    while other threads (a server decoding) launch as usual; overlapping blocks in two threads put
    Triton's launch back as it was."""
    from triton.compiler import compiler
    from triton.runtime.jit import JITFunction

    import snac_fast.compiling as compiling

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
    import snac_fast.compiling as compiling

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
    import snac_fast.compiling as compiling

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

    import snac_fast.compiling as compiling

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
    import snac_fast.compiling as compiling

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


@pytest.mark.gpu
def test_gpu_server_contexts(cuda):
    """Graphs under inference_mode, threads sharing graph buffers, a caller's side stream."""
    with torch.inference_mode():
        codec = FastSNAC.from_pretrained("synthetic:snac_24khz", device=cuda)
    jobs = [(random_codes(codec.config, 4 if j % 2 else 16, batch=1 + j % 3, seed=j), 50 + j) for j in range(12)]
    expected = [codec.decode(codes, seed=seed).clone() for codes, seed in jobs]
    for got, want in zip(_decode_in_threads(codec, jobs), expected):
        assert torch.equal(got, want)
    side = torch.cuda.Stream(cuda)
    with torch.cuda.stream(side):
        codes, seed = jobs[0]
        got = codec.decode(codes, seed=seed)
        side.synchronize()
    assert torch.equal(got, expected[0])


@pytest.mark.gpu
def test_gpu_out_of_memory_during_capture_is_clear_and_recoverable(cuda, monkeypatch):
    codec = FastSNAC.from_pretrained("synthetic:snac_24khz", device=cuda)
    codes = random_codes(codec.config, 4, seed=1)
    expected = codec.decode(codes, seed=2).clone()
    codec.graphs.clear()

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch.cuda, "graph", no_memory)
    with pytest.raises(RuntimeError, match="out of memory.*CUDA graph"):
        codec.decode(codes, seed=2)
    monkeypatch.undo()
    assert torch.equal(codec.decode(codes, seed=2), expected)


@pytest.mark.gpu
def test_gpu_models_on_two_devices():
    """A model on cuda:1 while cuda:0 is current, next to one on cuda:0, in one process."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (the nvidia-h200-x2 device kind)")
    torch.cuda.set_device(0)
    first = FastSNAC.from_pretrained("synthetic:snac_24khz", device="cuda:0")
    second = FastSNAC.from_pretrained("synthetic:snac_24khz", device="cuda:1")
    codes = random_codes(first.config, 6, batch=2, seed=8)
    on_first, on_second = first.decode(codes, seed=4), second.decode(codes, seed=4)
    assert torch.cuda.current_device() == 0 and on_second.device == torch.device("cuda:1")
    assert torch.equal(on_first.cpu(), on_second.cpu())  # same GPUs, same kernels, same noise
    stream = second.stream(seed=4)
    strides = second.config["vq_strides"]
    pieces = [stream.push([c[:1, f * strides[0] // s:(f + 1) * strides[0] // s] for c, s in zip(codes, strides)])
              for f in range(6)] + [stream.flush()]
    assert torch.cat(pieces).device == torch.device("cuda:1")
    assert snr_db(on_second[0, 0].float(), torch.cat(pieces).float()) >= 50  # fp16 rounding apart
    with torch.cuda.device(1):
        assert torch.equal(first.decode(codes, seed=4).cpu(), on_first.cpu())


@pytest.mark.gpu
def test_runtime_warms_up_while_the_model_builds(cuda):
    """from_pretrained starts CUDA and Triton's cache key on background threads and joins them
    before it returns: the first launch finds the key ready (read back from the cache directory, or
    computed once into Triton's lru_cache), never hashed a second time."""
    from triton.runtime import cache

    from snac_fast.ops import _runtime

    FastSNAC.from_pretrained("synthetic:snac_24khz", device=cuda)
    assert len(_runtime._runtime_warmup) == 2 and not any(t.is_alive() for t in _runtime._runtime_warmup)
    key = cache.triton_key
    assert not hasattr(key, "cache_info") or key.cache_info().currsize == 1


def test_triton_key_is_kept_beside_the_kernels(tmp_path, monkeypatch):
    """Triton's cache key (a 0.4-1.4 s hash of its compiler at a process's first launch) is stored in
    the Triton cache directory and reused while Triton's files are unchanged; a stale entry is not."""
    import json

    from triton.runtime import cache

    from snac_fast.ops import _runtime

    original = cache.triton_key
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    stored = tmp_path / _runtime.TRITON_KEY_FILE
    try:
        _runtime._triton_key()  # computed as Triton does, and stored
        assert cache.triton_key is original and json.loads(stored.read_text())["key"] == original()
        _runtime._triton_key()  # read back
        assert cache.triton_key is not original and cache.triton_key() == original()
        cache.triton_key = original
        stored.write_text(json.dumps({"stamp": "files since changed", "key": "stale"}))
        _runtime._triton_key()
        assert cache.triton_key() == original() and json.loads(stored.read_text())["key"] == original()
    finally:
        cache.triton_key = original


def test_failed_compile_clears_async_compile_mode():
    """A compile that fails inside compiling_concurrently() raises its own error, and the thread
    can compile concurrently again (Triton's AsyncCompileMode left itself active on such a failure,
    and every later warm-up then failed with 'Another AsyncCompileMode is already active')."""
    from triton.runtime._async_compile import active_mode

    import snac_fast.compiling as compiling

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
