"""CUDA-graph decodes: the cache's logic (CPU) and graphs against eager (GPU)."""

import pytest
import torch
from helpers import random_codes

from snac_fast import FastSNAC
from snac_fast.runtime.graphs import GraphedDecode


class _FakeGraph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def fake_snac(codebook_size=4096):
    """Just what GraphedDecode reads of a model: the codebook size."""
    model = torch.nn.Module()
    model.quantizer = torch.nn.Module()
    level = torch.nn.Module()
    level.codebook = torch.nn.Embedding(codebook_size, 1)
    model.quantizer.quantizers = torch.nn.ModuleList([level])
    return model


def test_graph_cache_is_bounded_lru_and_checks_cpu_ids(monkeypatch):
    from snac_fast.runtime.graphs import _Captured

    def fake_capture(self, codes, noise):  # (the cache counts captures as it stores them)
        flag = torch.zeros(1, dtype=torch.int32)
        return _Captured(_FakeGraph(), torch.zeros(sum(c.numel() for c in codes), dtype=torch.long), torch.zeros(1),
                         [], None, torch.zeros(1), flag)

    monkeypatch.setattr(GraphedDecode, "_capture", fake_capture)
    runner = GraphedDecode(fake_snac(), "cpu", max_graphs=2)
    validated = []
    shapes = [(1, 4), (1, 8), (1, 4), (1, 12), (1, 8)]
    for s in shapes:
        runner([torch.zeros(s, dtype=torch.long)], validate=lambda codes: validated.append(tuple(codes[0].shape)))
    assert len(runner) == 2 and runner.captures == 4  # (1,4) reused once; (1,8) evicted then recaptured
    assert validated == [(1, 4), (1, 8), (1, 12), (1, 8)]  # structural checks only before a capture
    assert [k[0][0] for k in runner.keys()] == [(1, 12), (1, 8)]

    def reject(codes):
        raise ValueError("codes must be a list of tensors")

    for wrong in (torch.ones(1, 8), [1, 2], None):  # no key to look up: validate explains, nothing captured
        with pytest.raises(ValueError, match="list of tensors"):
            runner(wrong, validate=reject)
    assert runner.captures == 4
    out = runner([torch.zeros((1, 8), dtype=torch.long)])
    entry = runner._cache[runner.keys()[-1]]
    assert out is not entry.output  # a copy unless asked otherwise
    assert runner([torch.zeros((1, 8), dtype=torch.long)], copy_output=False) is entry.output
    codes = [torch.arange(8).view(1, 8)]
    runner(codes)
    assert torch.equal(entry.codes, codes[0].view(-1))  # the codes went into the static buffer
    replays = entry.graph.replays
    with pytest.raises(ValueError, match="holds id 4096"):
        runner([torch.full((1, 8), 4096)])
    assert entry.graph.replays == replays  # CPU codes: checked before the launch
    with pytest.raises(ValueError):
        GraphedDecode(fake_snac(), "cpu", max_graphs=0)


def test_graphs_need_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        FastSNAC.from_pretrained("synthetic:snac_24khz", device="cpu", cuda_graphs=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["snac_24khz", "snac_32khz"])
def test_gpu_graphs_match_eager_and_keep_outputs(cuda, name):
    graphed = FastSNAC.from_pretrained(f"synthetic:{name}", device=cuda, max_graphs=2)
    eager = FastSNAC.from_pretrained(f"synthetic:{name}", device=cuda, cuda_graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    codes = random_codes(graphed.config, 8, batch=2, seed=0)
    a = graphed.decode(codes, seed=3)
    assert torch.equal(a, graphed.decode(codes, seed=3))  # same seed, same audio, on replay too
    b = eager.decode(codes, seed=3)
    assert (a.float() - b.float()).abs().max().item() <= 2e-3  # same noise; kernels may pick other tiles
    first = a.clone()
    graphed.decode(random_codes(graphed.config, 8, batch=2, seed=1), seed=4)
    assert torch.equal(a, first), "a later replay overwrote an earlier result"
    gpu_codes = [c.to(cuda) for c in codes]
    assert torch.equal(graphed.decode(gpu_codes, seed=3), a)  # the same graph, fed from GPU codes
    bad = [c.clone() for c in gpu_codes]
    bad[-1][1, -1] = graphed.config["codebook_size"]
    for wrong in (bad, [c.cpu() for c in bad]):  # flagged in the graph; checked on the CPU before it
        with pytest.raises(ValueError, match=f"level {len(bad) - 1} holds id {graphed.config['codebook_size']}"):
            graphed.decode(wrong)
    assert torch.equal(graphed.decode(gpu_codes, seed=3), a)  # the flag was cleared
    view = graphed.decode(codes, seed=3, reuse_output=True)
    assert graphed.decode(codes, seed=5, reuse_output=True).data_ptr() == view.data_ptr()
    for n in (4, 12, 16):  # eviction keeps at most max_graphs
        graphed.decode(random_codes(graphed.config, n), seed=0)
    assert len(graphed.graphs) == 2
    assert not torch.equal(graphed.decode(codes), graphed.decode(codes))  # no seed: fresh noise
