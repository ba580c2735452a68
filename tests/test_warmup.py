"""The warm-up's compile pass and its manifest: skipped only when every kernel file it used is cached."""

import contextlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import snac_fast.runtime.warmup as warmup


@pytest.fixture
def fake_pass(monkeypatch, tmp_path):
    """compile_kernels with a compile pass that records its runs and 'uses' three cache files."""
    files = [tmp_path / f"kernel{i}.cubin" for i in range(3)]
    for f in files:
        f.write_bytes(b"\0")
    runs = []

    @contextlib.contextmanager
    def compile_pass(workers=None):
        runs.append(workers)
        yield [str(f) for f in files]
    manifest = tmp_path / "snac_fast_warmups" / "key.json"
    monkeypatch.setattr(warmup, "compiling_concurrently", compile_pass)
    monkeypatch.setattr(warmup, "_manifest_path", lambda *args: manifest)
    monkeypatch.setattr(warmup, "_launch_decode", lambda codec, codes: None)
    monkeypatch.setattr(warmup, "_zero_codes", lambda codec, batch, frames: None)
    monkeypatch.setattr(warmup, "device_scope", lambda device: contextlib.nullcontext())
    codec = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    return SimpleNamespace(run=lambda: warmup.compile_kernels(codec, [(1, 4)]), runs=runs, files=files, manifest=manifest)


def test_a_complete_manifest_skips_the_compile_pass(fake_pass):
    fake_pass.run()
    assert len(fake_pass.runs) == 1
    assert sorted(json.loads(fake_pass.manifest.read_text())["files"]) == sorted(map(str, fake_pass.files))
    fake_pass.run()
    assert len(fake_pass.runs) == 1  # every file there: skipped


def test_a_missing_kernel_file_or_a_broken_manifest_runs_the_pass_again(fake_pass):
    fake_pass.run()
    fake_pass.files[1].unlink()
    fake_pass.run()
    assert len(fake_pass.runs) == 2
    fake_pass.files[1].write_bytes(b"\0")
    fake_pass.manifest.write_text("{not json")
    fake_pass.run()
    assert len(fake_pass.runs) == 3
    fake_pass.run()  # the pass rewrote it
    assert len(fake_pass.runs) == 3


def test_the_manifest_key_follows_what_decides_the_kernels(monkeypatch, tmp_path):
    from triton import knobs

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU A")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    codec = SimpleNamespace(config={"sampling_rate": 24000}, dtype=torch.float16, graphs=object(), device="cuda:0")
    path = warmup._manifest_path(codec, [(1, 4)], None, 0)
    assert path is not None and path.parent == tmp_path / "snac_fast_warmups"
    assert warmup._manifest_path(codec, [(1, 4)], None, 0) == path
    assert warmup._manifest_path(codec, [(1, 8)], None, 0) != path
    assert warmup._manifest_path(SimpleNamespace(**{**vars(codec), "dtype": torch.float32}), [(1, 4)], None, 0) != path
    assert warmup._manifest_path(SimpleNamespace(**{**vars(codec), "config": {"sampling_rate": 32000}}), [(1, 4)], None, 0) != path
    monkeypatch.setenv("SNAC_FAST_GLUON", "0")
    assert warmup._manifest_path(codec, [(1, 4)], None, 0) != path
    monkeypatch.delenv("SNAC_FAST_GLUON")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU B")
    assert warmup._manifest_path(codec, [(1, 4)], None, 0) != path
    monkeypatch.setenv("TRITON_ALWAYS_COMPILE", "1")
    assert knobs.compilation.always_compile
    assert warmup._manifest_path(codec, [(1, 4)], None, 0) is None


WARM_TWICE = """
import hashlib, sys, torch
from snac_fast import FastSNAC
import snac_fast.runtime.warmup as warmup
passes, real = [], warmup.compiling_concurrently
def counted(*args, **kwargs):
    passes.append(1)
    return real(*args, **kwargs)
warmup.compiling_concurrently = counted
codec = FastSNAC.from_pretrained("synthetic:snac_24khz", device="cuda")
codec.warmup(batch_sizes=[1], frames=[4], streams=2)
engine = codec.shared_stream_engine()
gen = torch.Generator().manual_seed(1)
codes = [torch.randint(0, 4096, (1, 12 * n), generator=gen).cuda() for n in (1, 2, 4)]
stream = engine.open(seed=3)
pieces = [engine.advance({stream: [c[:, 4 * n * i:4 * n * (i + 1)] for c, n in zip(codes, (1, 2, 4))]})[stream] for i in range(3)]
audio = torch.cat(pieces + [engine.advance(finish=[stream])[stream]])
print(len(passes), hashlib.sha256(audio.float().cpu().numpy().tobytes()).hexdigest())
"""


@pytest.mark.gpu
def test_gpu_a_warm_start_skips_the_compile_pass_and_streams_the_same_audio(tmp_path):
    """Two fresh processes on one Triton cache: the first runs the compile pass and writes its
    manifest, the second skips it, and both stream bitwise the same audio."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}
    outputs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", WARM_TWICE], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        outputs.append(out.stdout.split())
    assert outputs[0][0] == "1" and outputs[1][0] == "0"
    assert outputs[0][1] == outputs[1][1]
    assert len(list((tmp_path / "snac_fast_warmups").glob("*.json"))) == 1


def test_the_compile_pool_records_each_kernels_cache_files(monkeypatch):
    """What a compile pass's manifest lists: every job's kernel files in Triton's cache, from the
    pool's threads (a job whose kernel has none adds nothing)."""
    import snac_fast.runtime.compiling as compiling

    kernels = {f"k{i}": SimpleNamespace(metadata_group={f"k{i}.json": f"/cache/k{i}/k{i}.json", f"k{i}.cubin": f"/cache/k{i}/k{i}.cubin"})
               for i in range(5)}
    monkeypatch.setattr(compiling, "COMPILE_IN_FORKS", False)
    monkeypatch.setattr(compiling, "_compiled_with_launcher", lambda compile_fn, *a, **k: compile_fn(*a, **k))
    with compiling._CompileAndBuildLauncher(3) as pool:
        futures = [pool.submit(lambda name=name: kernels[name]) for name in kernels] + [pool.submit(lambda: object())]
        results = [f.result() for f in futures]
    assert results[:5] == list(kernels.values())
    assert sorted(pool.cached_files) == sorted(p for k in kernels.values() for p in k.metadata_group.values())
