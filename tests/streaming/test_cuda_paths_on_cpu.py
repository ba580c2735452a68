"""The stream engine's CUDA-graph paths (its graphs' memory pool, capture and replay), run on the CPU through fakes of torch.cuda's entry points that check their
arguments as torch does (tests/fake_cuda.py): an unindexed CUDA device, what users pass, reached
``torch.cuda.use_mem_pool`` and failed every GPU warm-up at start-up, with no CPU test to see it."""

import pytest
import torch
from fake_cuda import FakeCuda, indexed, optional_index
from helpers import engine64, frames_of, random_codes
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


def graphed_engine(streams: int):
    """A float64 engine on the CPU with its CUDA-graph paths switched on (the fakes stand in)."""
    engine = engine64("snac_24khz", streams=streams, layered=False)
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

