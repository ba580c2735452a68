"""GPU memory: the warm-up's bucket choice under a budget (CPU), and what an engine holds (gpu)."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from snac_fast.serve.engine.gpu_memory import GB, WARMUP_FACTOR, choose_max_batch, memory_readings, process_bytes
from snac_fast.serve import ServeSettings
from snac_fast.streaming.shapes import warmup_buckets


@pytest.mark.parametrize("per_row_mb", [0.3, 1.5, 7.0])
@pytest.mark.parametrize("budget_gb", [1.0, 2.0, 8.0])
def test_the_largest_bucket_that_fits_is_chosen(per_row_mb, budget_gb):
    held, fixed, per_row = 0.7 * GB, 20e6, per_row_mb * 1e6
    need = lambda rows: held + WARMUP_FACTOR * (fixed + per_row * rows)  # noqa: E731
    top, figures = choose_max_batch(budget_gb * GB, held, fixed, per_row, 512)
    buckets = warmup_buckets(512)
    assert top in buckets and need(top) <= budget_gb * GB
    larger = [b for b in buckets if b > top]
    assert not larger or need(larger[0]) > budget_gb * GB
    assert figures["max_batch"] == top and figures["need_gb"] <= budget_gb


def test_the_choice_grows_with_the_budget_and_stops_at_max_batch():
    tops = [choose_max_batch(b * GB, 0.6 * GB, 10e6, 2e6, 256)[0] for b in (0.8, 1.0, 1.5, 2.0, 4.0, 64.0)]
    assert tops == sorted(tops) and tops[-1] == 256 and tops[0] < 256


def test_steps_in_slices_of_rows_fit_larger_calls_in_the_same_budget():
    """With rows_per_pass, a step's intermediates stop growing at a slice's rows: a budget that
    fits 64-row steps whole fits every call up to max_batch in slices of 32."""
    held, fixed, per_row = 0.6 * GB, 10e6, 4e6
    whole, _ = choose_max_batch(1.0 * GB, held, fixed, per_row, 512)
    sliced, figures = choose_max_batch(1.0 * GB, held, fixed, per_row, 512, rows_per_pass=32)
    assert whole < 512 and sliced == 512
    assert figures["need_gb"] == round((held + WARMUP_FACTOR * (fixed + per_row * 32)) / GB, 3)
    assert choose_max_batch(1.0 * GB, held, fixed, per_row, 512, rows_per_pass=4096)[0] == whole


def test_a_budget_that_fits_no_step_is_refused_by_name():
    with pytest.raises(ValueError, match=r"--gpu-memory-gb 0\.5 does not fit .*0\.70 GB .*lower --max-streams"):
        choose_max_batch(0.5 * GB, 0.7 * GB, 10e6, 2e6, 256, "0.08 GB of state for 1024 streams")


def test_the_budget_setting_is_checked():
    assert ServeSettings.of(gpu_memory_gb=2).check().engine.gpu_memory_gb == 2
    with pytest.raises(ValueError, match="--gpu-memory-gb must be >= 0"):
        ServeSettings.of(gpu_memory_gb=-1).check()
    assert ServeSettings.of(rows_per_pass=128).check().engine.rows_per_pass == 128
    with pytest.raises(ValueError, match="--rows-per-pass must be >= 0"):
        ServeSettings.of(rows_per_pass=-1).check()


def test_no_gpu_memory_is_read_off_cuda():
    assert memory_readings("cpu") == {}


def test_nvml_reads_the_gpu_cuda_means_not_the_one_of_the_same_number(monkeypatch):
    """CUDA numbers the visible GPUs, NVML all of them: with CUDA_VISIBLE_DEVICES=2, CUDA's device 0
    is NVML's 2. The process's memory is read from the GPU with the CUDA device's UUID."""
    pid = os.getpid()
    held = {"GPU-aaaa": [], "GPU-bbbb": [], "GPU-cccc": [types.SimpleNamespace(pid=pid, usedGpuMemory=123 << 20)]}
    order = list(held)
    nvml = types.SimpleNamespace(
        NVMLError=RuntimeError, nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: order[i],
        nvmlDeviceGetHandleByUUID=lambda uuid: uuid if uuid in held else (_ for _ in ()).throw(RuntimeError(uuid)),
        nvmlDeviceGetComputeRunningProcesses=lambda handle: held[handle])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=["cccc"][i]))
    assert process_bytes("cuda") == process_bytes("cuda:0") == 123 << 20
    # no UUID that NVML knows (a MIG instance): NVML's numbering, as before
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid="dddd"))
    assert process_bytes("cuda:2") == 123 << 20 and process_bytes("cuda:0") is None


@pytest.mark.gpu
def test_the_readme_recipe_reserves_what_it_serves_with():
    """shared_stream_engine(max_streams=1024) and warmup(streams=256): the step graphs share one pool
    on one capture stream and the warm-up's transients are handed back: within 1.5 GB reserved."""
    from snac_fast import FastSNAC

    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    codec = FastSNAC.from_pretrained("synthetic:snac_24khz", device="cuda")
    codec.shared_stream_engine(max_streams=1024)
    codec.warmup(streams=256)
    reserved = torch.cuda.memory_reserved() - before
    assert reserved <= 1.5 * GB, f"{reserved / GB:.2f} GB reserved"


# run in a fresh process: NVML counts the whole process, so a pytest worker that ran other gpu tests
# first read its neighbours' memory (5.84 GB "held" against a 1.5 GB budget), not the budget's
_BUDGET_CHECK = """
import json, torch
from snac_fast import FastSNAC
from snac_fast.serve.engine.gpu_memory import GB, context_bytes, fit_max_batch

codec = FastSNAC.from_pretrained("synthetic:snac_24khz", device="cuda")
engine = codec.stream_engine(1024)
small, figures = fit_max_batch(engine, int(1.5 * GB), 512)
large, _ = fit_max_batch(engine, int(2.5 * GB), 512)
try:
    fit_max_batch(engine, int(0.3 * GB), 512)
    refused = ""
except ValueError as error:
    refused = str(error)
torch.cuda.reset_peak_memory_stats()
engine.warmup(max_batch=small)
torch.cuda.empty_cache()
peak = torch.cuda.max_memory_reserved() + context_bytes(engine.device)
print(json.dumps({"small": small, "large": large, "refused": refused, "peak": peak, "figures": figures}))
"""


@pytest.mark.gpu
def test_a_budget_is_honoured_by_the_warm_up():
    """fit_max_batch's bucket, warmed up in a fresh process, keeps the process (NVML's figure, else
    the reserve and the context estimate) inside the budget at the warm-up's peak; a smaller budget
    chooses a smaller bucket; one below what the process holds already is refused by name."""
    done = subprocess.run([sys.executable, "-c", _BUDGET_CHECK], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["small"] <= got["large"]
    assert "--gpu-memory-gb 0.3 does not fit" in got["refused"], got["refused"]
    peak = got["peak"]
    assert peak <= 1.5 * GB * 1.05, f"{peak / GB:.2f} GB at the warm-up's peak for a 1.5 GB budget ({got['figures']})"


@pytest.mark.gpu
def test_the_step_graphs_pool_is_about_the_largest_steps_intermediates():
    """The pool is reserved as one segment a tenth above the largest step's intermediates before
    any pass or capture, and every graph (and the warm-up's eager passes) fits in it: left to grow
    on demand it came to twice that (1.97 GB for 0.94 GB, 256 streams on an H200)."""
    from snac_fast import FastSNAC

    codec = FastSNAC.from_pretrained("synthetic:snac_24khz", device="cuda")
    engine = codec.stream_engine(256)
    most = engine.intermediates(256)
    engine.warmup(max_batch=256)
    pool = [s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == tuple(engine.steps.pool.id)]
    held = sum(s["total_size"] for s in pool)
    assert most > 0 and held <= 1.25 * most, f"pool {held / GB:.3f} GB in {len(pool)} segments for {most / GB:.3f} GB"


@pytest.mark.gpu
def test_a_step_in_slices_of_rows_allocates_a_slices_intermediates():
    """rows_per_pass=64: the largest 256-row step allocates about a 64-row step's intermediates,
    well under half the whole step's (what lets the graphs' pool shrink)."""
    from snac_fast import FastSNAC

    codec = FastSNAC.from_pretrained("synthetic:snac_24khz", device="cuda")
    engine = codec.stream_engine(256, rows_per_pass=None)  # whole steps first
    whole, at_64 = engine.intermediates(256), engine.intermediates(64)
    engine.rows_per_pass = 64
    sliced = engine.intermediates(256)
    assert sliced <= 0.4 * whole and sliced <= 1.1 * at_64, (sliced / GB, whole / GB, at_64 / GB)
