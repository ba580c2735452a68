"""The stream engine's CUDA-graph paths (its graphs' memory pool, capture and replay), run on the CPU through fakes of torch.cuda's entry points that check their
arguments as torch does (tests/fake_cuda.py): an unindexed CUDA device, what users pass, reached
``torch.cuda.use_mem_pool`` and failed every GPU warm-up at start-up, with no CPU test to see it."""

import pytest
import torch
from fake_cuda import FakeCuda, indexed, optional_index
from helpers import NARROW, engine64, frames_of, random_codes
from torch.cuda._utils import _get_device_index

from snac_fast.configs import published_config
from snac_fast.streaming import step_graph


@pytest.fixture
def fake_cuda(monkeypatch):
    return FakeCuda().install(monkeypatch)


def test_the_fakes_refuse_what_torch_refuses():
    """The stand-in for torch.device("cuda") is refused where torch refuses that device (so the
    engine test below can fail), and accepted where torch takes the current device."""
    with pytest.raises(ValueError, match="specified index"):
        _get_device_index(torch.device("cuda"), optional=False)  # torch itself, no GPU needed
    with pytest.raises(ValueError, match="specified index"):
        indexed(torch.device("cpu"))
    assert indexed(torch.device("cpu", 1)) == 1 and indexed(2) == 2 and indexed(torch.device("cuda", 3)) == 3
    assert optional_index(torch.device("cpu")) == 0 and optional_index(None) == 0
    with pytest.raises(ValueError, match="cuda device"):
        optional_index(torch.device("meta"))


def graphed_engine(streams: int, narrow: bool = False):
    """A float64 engine on the CPU with its CUDA-graph paths switched on (the fakes stand in);
    ``narrow``: helpers.NARROW's widths."""
    engine = engine64("snac_24khz", streams=streams, narrow=narrow, layered=False)
    engine.steps.cuda_graphs, engine.steps.pool = True, torch.cuda.MemPool()
    return engine


@pytest.mark.parametrize("outside", [False, True], ids=["buffers in the pool", "buffers outside the pool"])
def test_an_unindexed_device_warms_up_captures_and_steps(fake_cuda, monkeypatch, outside):
    monkeypatch.setattr(step_graph, "BUFFERS_OUTSIDE_POOL", outside)
    engine = graphed_engine(streams=3)
    assert engine.device.index is None
    engine.compile_steps(max_batch=2)
    graphs = engine.warmup(max_batch=2)
    assert graphs > 0 and fake_cuda.captures == graphs
    assert fake_cuda.pools_entered and set(fake_cuda.pools_entered) == {0}
    config = published_config("snac_24khz")
    strides = config["vq_strides"]
    frames = engine.prefill_frames + 2
    codes = random_codes(config, frames, batch=2, seed=3)
    streams = [engine.open(seed=4, row=b) for b in range(2)]
    for start, stop in [(0, engine.prefill_frames), (engine.prefill_frames, frames)]:
        rows = [torch.cat([frames_of(codes, strides, start, stop, row=b)[i] for b in range(2)]) for i in range(3)]
        pieces = engine.step(streams, rows)
        assert len(pieces) == 2 and all(p.dtype == torch.float64 and p.ndim == 1 for p in pieces)
    assert fake_cuda.calls["synchronize"] > 0



@pytest.mark.parametrize("kind", ["prefill", "step", "flush"])
def test_a_captured_step_in_slices_of_rows_outputs_the_whole_steps_audio(fake_cuda, kind):
    """A step graph captured with rows_per_pass runs its stages on slices of the rows, each taking
    its rows of the graph's noise buffers (drawn once for the whole step, beside the first layers):
    its output equals the graph of the whole step's, row for row, from the same state."""
    engine = graphed_engine(streams=4, narrow=True)
    config = {**published_config("snac_24khz"), **NARROW}
    frames = {"prefill": engine.prefill_frames, "step": engine.frames_per_group, "flush": 0}[kind]
    keys = torch.zeros((4, 4), dtype=torch.int64)
    keys[0], keys[1], keys[2], keys[3] = torch.arange(4), 3 * engine.prefill_frames, 7, torch.arange(4)
    codes = [] if kind == "flush" else [c.numpy() for c in random_codes(config, frames, batch=4, seed=9)]
    for state in engine.state:  # a context that is not all zeros, the same for both captures
        state.copy_(torch.randn(state.shape, dtype=state.dtype, generator=torch.Generator().manual_seed(5)))
    whole = engine.steps._step_graph(kind, keys.numpy(), codes, frames).output.clone()
    engine.rows_per_pass = 3  # slices of 3 and 1
    sliced = engine.steps._step_graph(kind, keys.numpy(), codes, frames).output
    assert sliced.shape == whole.shape == (4, 1, sliced.shape[2]) and sliced.shape[2] > 0
    torch.testing.assert_close(sliced, whole, rtol=0, atol=1e-12)
