"""The GPUs users have (Ampere, Ada), checked on a CPU machine: the launch rules read a device's
limits (capability, SM count, shared memory), a configuration a device refuses falls back to a
smaller one, and every configuration the rules choose for the three models' workloads on an A100,
RTX 3090, L4 and RTX 4090 compiles for that architecture within its shared memory (snac_fast.targets)."""

import dataclasses
import warnings

import pytest
import torch

from snac_fast.ops import device as ops_device
from snac_fast.ops import launch as ops_launch
from snac_fast.ops.conv_transpose import conv_transpose, conv_transpose_reference
from snac_fast.ops.device import GPUS, GpuLimits, emulate_gpu, gpu_limits
from snac_fast.ops.launch import has_tma, launch_flags, wave_programs

pytestmark = pytest.mark.skipif(not ops_device.TRITON_INTERPRET, reason="records launches through Triton's interpreter")
CPU = torch.device("cpu")


def close(got, ref):
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_rules_read_the_emulated_devices_limits(monkeypatch):
    assert gpu_limits(CPU) is None and wave_programs(CPU) == 1  # the interpreter's own configurations
    with emulate_gpu(GPUS["l4"]):
        assert wave_programs(CPU) == 32 and not has_tma(CPU) and launch_flags(CPU, 4) == {"PDL": False, "launch_pdl": False}
    with emulate_gpu(GPUS["rtx4090"]):
        assert wave_programs(CPU) == 128 and not has_tma(CPU)
    with emulate_gpu(GPUS["h100"]):
        assert wave_programs(CPU) == 128 and has_tma(CPU) and launch_flags(CPU, 4)["PDL"]
        assert launch_flags(CPU, 8 * 128)["PDL"] and not launch_flags(CPU, 8 * 128 + 1)["PDL"]  # long grids lose by it
        monkeypatch.setenv("SNAC_FAST_PDL", "0")
        assert not launch_flags(CPU, 4)["PDL"]  # switched off
    assert gpu_limits(CPU) is None
    with pytest.raises(ValueError, match="must be positive"):
        GpuLimits("none", (8, 6), 0, 1)


def test_gpus_before_ampere_take_the_reference_path_with_one_warning(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Tesla T4")
    ops_device._supported.cache_clear()
    try:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (7, 5))
        with pytest.warns(RuntimeWarning, match=r"Tesla T4 \(sm_75\) is older than Ampere"):
            assert not ops_device._supported(0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not ops_device._supported(0)  # once
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 6))
        assert ops_device._supported(1)
    finally:
        ops_device._supported.cache_clear()


def test_a_configuration_the_device_refuses_falls_back_to_a_smaller_one(monkeypatch):
    """A card with less shared memory than the rules assumed: the transposed conv's launch raises
    OutOfResources for stages > 1 or BLOCK_K > 16 (as Triton does at launch); the call still returns
    the right audio, warns once, and the next call goes straight to the configuration that fits."""
    from triton.runtime.errors import OutOfResources

    from snac_fast.ops import conv_transpose as module

    kernel, refused = module._conv_transpose_kernel, []

    class SmallCard:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if kwargs["num_stages"] > 1 or kwargs["BLOCK_K"] > 16:
                    refused.append((kwargs["num_stages"], kwargs["BLOCK_K"]))
                    raise OutOfResources(150000, 101376, "shared memory")
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, "_conv_transpose_kernel", SmallCard())
    monkeypatch.setattr(ops_launch, "_fitted", {})
    gen = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(2, 64, 9, generator=gen), torch.randn(64, 32, 8, generator=gen) / 8, torch.randn(32, generator=gen)
    ref = conv_transpose_reference(x.double(), w.double(), b.double(), 4)
    with pytest.warns(RuntimeWarning, match="does not fit this GPU"):
        close(conv_transpose(x, w, b, 4), ref)
    assert refused and refused[-1] == (1, 32)  # stages 3 -> 2 -> 1, then BLOCK_K 64 -> 32 -> 16
    refused.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        close(conv_transpose(x, w, b, 4), ref)
    assert refused == []  # remembered


@pytest.mark.heavy
def test_every_configuration_the_rules_choose_fits_ampere_and_ada():
    """Decode chunks at B=1/32, 5 s and 60 s decodes, a 5 s encode and stream steps of 1/64/256
    streams of the three models in fp16, with the rules of an A100, RTX 3090, L4 and RTX 4090 (their
    SM counts give three wave sizes): every distinct kernel launch, compiled ahead of time for sm_86,
    uses no more shared memory than a block may have there (99 KB, the least of the four) and at
    most 255 registers a thread. sm_80 and sm_89 compile the same kernels (Triton's MMA v2 path):
    checked on the launches with the most shared memory."""
    from snac_fast.targets import MODELS, check_fits, record_launches, workloads

    launches = {}
    for gpu in ("a100", "rtx3090", "l4", "rtx4090"):
        for model in MODELS:
            for run in workloads(model).values():
                launches.update(dict.fromkeys(record_launches(run, GPUS[gpu])))
    kinds = {launch.kernel for launch in launches}
    assert {"_conv_transpose_kernel", "_pointwise_conv_kernel", "_depthwise_conv_snake_kernel",
            "_dense_conv_kernel", "_local_attention_kernel"} <= kinds  # the workloads reached the kernels
    assert "_pointwise_conv_tma_kernel" not in kinds  # no TMA before sm_90
    fits = check_fits(list(launches), GPUS["rtx3090"], workers=2)
    assert len(fits) == len(launches)
    too_big = [(f.launch.describe(), f.shared, f.registers) for f in fits if not f.fits]
    assert not too_big, too_big
    biggest = sorted(fits, key=lambda f: -f.shared)[:4]
    small = GpuLimits("a card of 64 KB", (8, 6), 82, 65536)
    assert not check_fits([biggest[0].launch], small, workers=1)[0].fits  # the check can fail
    for gpu in ("a100", "rtx4090"):
        same = check_fits([f.launch for f in biggest], GPUS[gpu], workers=2)
        assert [f.shared for f in same] == [f.shared for f in biggest]
        assert all(f.fits for f in same)


_COMPILE_TWICE = """
import collections, dataclasses, json, re, sys
from snac_fast.targets import _launch_from, compile_launch

def memory_ops(launch):
    ptx = compile_launch(launch, 90).asm["ptx"]
    return collections.Counter(re.findall(r"\\b((?:ld|st)\\.global[\\w.]*|cp\\.async\\.\\w+)", ptx))

for fields in json.load(sys.stdin):
    launch = _launch_from(fields)
    aligned = dataclasses.replace(launch, aligned=launch.aligned + ("T",))  # as Triton's own specialization would
    print(json.dumps([launch.kernel, memory_ops(launch), memory_ops(aligned)]))
"""


@pytest.mark.heavy
def test_lengths_that_are_multiples_of_8_share_one_variant_with_the_same_vector_access():
    """A cold start compiles every distinct launch. The depthwise and 1x1-conv kernels do not
    specialize T on 16-divisibility (lengths that are multiples of 8 but not 16 compiled a second
    variant of each); they are told T % 8 == 0 instead. So T = 1032 and 1040 launch one variant each,
    and its loads and stores, compiled for sm_90, are those Triton's divisible-by-16 T gave (a hint
    the compiler ignores, such as tl.multiple_of on an argument, left scalar stores: 20% slower)."""
    import json
    import os
    import subprocess
    import sys

    from snac_fast.ops.depthwise import depthwise_conv_snake
    from snac_fast.ops.pointwise import pointwise_conv
    from snac_fast.targets import record_launches

    def run(T: int):
        x = torch.zeros(1, 64, T, dtype=torch.float16)
        depthwise_conv_snake(x, torch.zeros(64, 1, 7, dtype=torch.float16), torch.zeros(64, dtype=torch.float16),
                             3, torch.ones(64, dtype=torch.float16))
        pointwise_conv(x, torch.zeros(64, 64, 1, dtype=torch.float16), torch.zeros(64, dtype=torch.float16))

    launches = record_launches(lambda: run(1032), GPUS["h100"])
    assert launches == record_launches(lambda: run(1040), GPUS["h100"])
    assert {launch.kernel for launch in launches} == {"_depthwise_conv_snake_kernel", "_pointwise_conv_kernel"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_TWICE], input=json.dumps([dataclasses.asdict(l) for l in launches]),
                          capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for kernel, hinted, specialized in map(json.loads, done.stdout.splitlines()):
        assert hinted == specialized, kernel
        assert any(".v4." in op or op.startswith("cp.async") for op in hinted), kernel  # vector access at all


_SINE_IN_PTX = """
import json, sys
from snac_fast.targets import _launch_from, compile_launch

for fields in json.load(sys.stdin):
    launch = _launch_from(fields)
    print(json.dumps([launch.kernel, "sin.approx.f32" in compile_launch(launch, 90).asm["ptx"]]))
"""


@pytest.mark.heavy
def test_half_outputs_take_the_sfu_sine_and_float32_the_exact_one():
    """A snake whose result is stored in fp16/bf16 takes its sine from the SFU (sin.approx.f32, ops/snake
    ``_sin_sfu``: long fp16 decodes ~4% faster at an unchanged SNR); float32 keeps the exact reduction
    and polynomial (float32 decodes >= 100 dB against upstream). The depthwise conv + snake and the 1x1
    conv with its pair epilogue (the TMA kernel for 16-bit types on an H100), compiled for sm_90."""
    import json
    import os
    import subprocess
    import sys

    from snac_fast.ops.depthwise import depthwise_conv_snake
    from snac_fast.ops.pointwise import pointwise_conv_pair
    from snac_fast.targets import record_launches

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        def run():
            x, v = torch.zeros(1, 64, 1024, dtype=dtype), torch.ones(64, dtype=dtype)
            depthwise_conv_snake(x, torch.zeros(64, 1, 7, dtype=dtype), v, 3, v)
            pointwise_conv_pair(x, torch.zeros(64, 64, 1, dtype=dtype), v, residual=x, alpha=v)

        launches = record_launches(run, GPUS["h100"])
        done = subprocess.run([sys.executable, "-c", _SINE_IN_PTX], input=json.dumps([dataclasses.asdict(l) for l in launches]),
                              capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        sfu = dict(map(json.loads, done.stdout.splitlines()))
        assert len(sfu) == 2 and "_depthwise_conv_snake_kernel" in sfu, sfu
        assert all(v == (dtype != torch.float32) for v in sfu.values()), (dtype, sfu)


def test_stream_steps_of_up_to_8_rows_take_the_one_row_steps_tiles():
    """Each tile a rule picks is a kernel variant a serving cold start compiles. Steps of 2, 4 and 8
    rows choose the depthwise and 1x1-conv tiles of the 1-row step (the rules see a launch that many
    times smaller), in every step kind; 16 rows choose their own again."""
    from snac_fast import FastSNAC
    from snac_fast.streaming.shapes import FLUSH, PREFILL, STEP
    from snac_fast.model.synthetic import synthetic_model
    from snac_fast.targets import record_launches

    engine = FastSNAC(synthetic_model("snac_24khz"), device="cpu", dtype=torch.float16).stream_engine(max_streams=16)
    tile_fields = ("K", "DILATION", "RUN", "ROWS", "BLOCK_T", "BLOCK_M", "BLOCK_N", "BLOCK_K", "PDL")

    def tiles(kind: str, rows: int, frames: int) -> set:
        inputs = engine.steps.warmup_inputs([(kind, rows, frames)])  # what warm-up launches for that step
        return {(l.kernel, l.num_warps, tuple((k, v) for k, v in l.constexprs if k in tile_fields))
                for l in record_launches(lambda: engine.steps.launch_shapes(inputs), GPUS["h100"])
                if l.kernel in ("_depthwise_conv_snake_kernel", "_pointwise_conv_kernel")}

    for kind, frames in ((STEP, engine.frames_per_group), (PREFILL, engine.prefill_frames), (FLUSH, 0)):
        one = tiles(kind, 1, frames)
        assert all(tiles(kind, rows, frames) == one for rows in (2, 4, 8)), kind
        assert tiles(kind, 16, frames) != one, kind


def test_a_recorded_launch_choice_is_reused_where_it_fits():
    """launches_as_recorded: recording launches keep their own choices (the first of a key is
    kept); the others take the recorded choice where it fits, else choose their own (as do the
    interpreter's launches, which compile nothing)."""
    from snac_fast.ops.launch import launch_choice, launches_as_recorded

    memo: dict = {}
    assert launch_choice("layer", lambda: "own") == "own"  # outside any scope: nothing recorded
    with emulate_gpu(GPUS["h100"]), launches_as_recorded(memo, record=True):
        assert launch_choice("layer", lambda: "step") == "step"
        assert launch_choice("layer", lambda: "step, again") == "step, again"
    assert memo == {"layer": "step"}
    with emulate_gpu(GPUS["h100"]), launches_as_recorded(memo, record=False):
        assert launch_choice("layer", lambda: "prefill") == "step"
        assert launch_choice("layer", lambda: "prefill", fits=lambda choice: False) == "prefill"
        assert launch_choice("other layer", lambda: "prefill") == "prefill"
    with launches_as_recorded(memo, record=False):  # the interpreter's launches choose their own
        assert launch_choice("layer", lambda: "prefill") == "prefill"
    assert memo == {"layer": "step"}


def test_prefills_and_flushes_launch_their_buckets_step_tiles():
    """Each tile a rule picks is a kernel variant a serving cold start compiles. A bucket's prefill
    and flush take the depthwise and 1x1-conv tiles its one-frame step chose (their lengths differ,
    so choices of their own were variants of their own), except where the step's tile needs an
    alignment their length lacks; warm-up runs each bucket's step first."""
    from snac_fast import FastSNAC
    from snac_fast.streaming.shapes import FLUSH, PREFILL, STEP
    from snac_fast.model.synthetic import synthetic_model
    from snac_fast.targets import record_launches

    codec = FastSNAC(synthetic_model("snac_24khz"), device="cpu", dtype=torch.float16)
    engine, fresh = codec.stream_engine(max_streams=16), codec.stream_engine(max_streams=16)
    tile_fields = ("K", "DILATION", "RUN", "ROWS", "BLOCK_T", "BLOCK_M", "BLOCK_N", "BLOCK_K", "PDL", "ALIGNED")

    def tiles(engine, kind: str, rows: int, frames: int) -> set:
        inputs = engine.steps.warmup_inputs([(kind, rows, frames)])
        return {(l.kernel, l.num_warps, tuple((k, v) for k, v in l.constexprs if k in tile_fields))
                for l in record_launches(lambda: engine.steps.launch_shapes(inputs), GPUS["h100"])
                if l.kernel in ("_depthwise_conv_snake_kernel", "_pointwise_conv_kernel")}

    order = [shape[0] for shape in engine.steps.warmup_shapes(16, ())]
    assert order[:3] == [STEP, PREFILL, FLUSH] and len(order) == 15
    for rows in (1, 16):
        step = tiles(engine, STEP, rows, engine.frames_per_group)
        others = tiles(engine, PREFILL, rows, engine.prefill_frames) | tiles(engine, FLUSH, rows, 0)
        own = tiles(fresh, PREFILL, rows, fresh.prefill_frames) | tiles(fresh, FLUSH, rows, 0)  # no step recorded
        assert len(own - step) >= 10, rows  # what the reuse saves
        # left: a flush's first layers, whose length is no multiple of 8 (the step's tiles for them need one)
        left = others - step
        assert len(left) <= 2 and all(not dict(t[2]).get(k) for t in left for k in ("RUN", "ALIGNED")), (rows, left)
