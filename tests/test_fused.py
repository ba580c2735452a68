"""Fused decoder kernels and modules against their unfused upstream layers; CUDA-graph cache logic."""

import pytest
import torch
from snac.layers import NoiseBlock, ResidualUnit

from helpers import random_codes
from snac_fast import FastSNAC
from snac_fast.modules import FastSnake1d, FusedNoiseBlock, FusedResidualUnit
from snac_fast.ops.conv import (depthwise_conv_snake, depthwise_conv_snake_reference, pointwise_conv,
                                pointwise_conv_reference)
from snac_fast.surgery import fold_weight_norm
from snac_fast.graphs import GraphedDecode

# residual-unit channel counts of the three published decoders (24 kHz; 32 and 44 kHz share theirs)
CHANNELS = [512, 256, 128, 64, 768, 384, 192, 96]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # relative to output scale


def close(got, ref, dtype):
    scale = ref.abs().max().item() + 1e-6
    err = (got.double() - ref.double()).abs().max().item()
    assert err <= TOL[dtype] * scale, f"max err {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dilation", [1, 3, 9])
@pytest.mark.parametrize("C", CHANNELS)
def test_depthwise_conv_snake(dtype, dilation, C):
    gen = torch.Generator().manual_seed(C * dilation)
    T = 37 if C >= 384 else 101  # odd lengths, shorter than the dilated kernel's span for C >= 384
    x = torch.randn(2, C, T, generator=gen).to(dtype)
    w = (torch.randn(C, 1, 7, generator=gen) * 0.4).to(dtype)
    b = torch.randn(C, generator=gen).to(dtype)
    alpha = torch.exp(torch.empty(C).uniform_(-1.6, 1.6, generator=gen))
    got = depthwise_conv_snake(x, w, b, dilation, alpha)
    close(got, depthwise_conv_snake_reference(x.double(), w.double(), b.double(), dilation, alpha.double()), dtype)
    plain = depthwise_conv_snake(x, w, None, dilation, None)  # no bias, no snake
    close(plain, depthwise_conv_snake_reference(x.double(), w.double(), None, dilation, None), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", CHANNELS)
def test_pointwise_conv(dtype, C):
    gen = torch.Generator().manual_seed(C)
    T = 45
    h = torch.randn(2, C, T, generator=gen).to(dtype)
    w = (torch.randn(C, C, 1, generator=gen) / C**0.5).to(dtype)
    b = torch.randn(C, generator=gen).to(dtype)
    res = torch.randn(2, C, T, generator=gen).to(dtype)
    scale = torch.randn(2, 1, T, generator=gen).to(dtype)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    ib = torch.randn(C, generator=gen).to(dtype)
    for args in [(b, res, None, None), (None, res, scale, None), (None, None, None, None), (b, None, scale, None),
                 (None, h, scale, ib), (b, None, None, ib)]:
        got = pointwise_conv(h, w, *args)
        close(got, pointwise_conv_reference(h.double(), w.double(), *map(d, args)), dtype)


@pytest.mark.parametrize("dilation", [1, 9])
def test_depthwise_interior_and_edge_tiles(dilation):
    """Long enough for interior tiles (unmasked loads) between the two edge tiles (masked)."""
    from snac_fast.ops.conv import _dw_config

    T = 3 * _dw_config(2, 10**9)[1] + 5
    gen = torch.Generator().manual_seed(dilation)
    x = torch.randn(1, 2, T, generator=gen)
    w = torch.randn(2, 1, 7, generator=gen)
    alpha = torch.tensor([0.7, 2.0])
    got = depthwise_conv_snake(x, w, None, dilation, alpha)
    close(got, depthwise_conv_snake_reference(x.double(), w.double(), None, dilation, alpha.double()), torch.float32)


def test_pointwise_conv_rectangular_and_poisoned(monkeypatch):
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(3, 768, 19, generator=gen)
    w = torch.randn(1024, 768, 1, generator=gen) / 28
    got = pointwise_conv(h, w)
    assert torch.isfinite(got).all()
    close(got, pointwise_conv_reference(h.double(), w.double()), torch.float32)


def test_argument_errors():
    x = torch.randn(1, 4, 10)
    with pytest.raises(ValueError, match="K odd"):
        depthwise_conv_snake(x, torch.randn(4, 1, 6))
    with pytest.raises(ValueError, match="need 4 values"):
        depthwise_conv_snake(x, torch.randn(4, 1, 7), torch.randn(3))
    with pytest.raises(ValueError, match=r"\[C_out, 4, 1\]"):
        pointwise_conv(x, torch.randn(4, 5, 1))
    with pytest.raises(ValueError, match="residual"):
        pointwise_conv(x, torch.randn(4, 4, 1), residual=torch.randn(1, 4, 9))
    with pytest.raises(ValueError, match="floating"):
        pointwise_conv(x.long(), torch.randn(4, 4, 1))


def upstream_unit(C, dilation, seed):
    torch.manual_seed(seed)
    unit = ResidualUnit(C, dilation=dilation, groups=C).eval()
    with torch.no_grad():
        for m in unit.modules():
            if hasattr(m, "alpha"):
                m.alpha.copy_(torch.exp(torch.empty_like(m.alpha).uniform_(-1.6, 1.6)))
    return unit


def fused_copy(unit):
    """A fused unit with the same weights, from a fresh upstream unit (deepcopy breaks weight norm)."""
    twin = upstream_unit(unit.block[0].alpha.shape[1], unit.block[1].dilation[0], 0)
    twin.load_state_dict(unit.state_dict())
    for i in (0, 2):
        twin.block[i] = FastSnake1d.from_snake(twin.block[i])
    fold_weight_norm(twin)
    return FusedResidualUnit.from_unit(twin)


@pytest.mark.parametrize("dilation", [1, 3, 9])
@pytest.mark.parametrize("C", [64, 96, 256])
def test_fused_residual_unit_matches_upstream(C, dilation):
    unit = upstream_unit(C, dilation, seed=C + dilation)
    fused = fused_copy(unit)
    assert fused.replaces == ("block.0", "block.1", "block.2", "block.3")
    assert set(fused.state_dict()) == {k.replace("parametrizations.weight.original0", "weight").replace(
        "parametrizations.weight.original1", "weight") for k in unit.state_dict()} - {
        k for k in unit.state_dict() if "original0" in k}
    x = torch.randn(2, C, 333)
    with torch.no_grad():
        close(fused(x), unit(x.double().float()).double(), torch.float32)
        close(fused.half()(x.half()), unit(x), torch.float16)


def test_fused_noise_block_matches_upstream():
    torch.manual_seed(1)
    block = NoiseBlock(64).eval()
    twin = NoiseBlock(64).eval()
    twin.load_state_dict(block.state_dict())
    fold_weight_norm(twin)
    fused = FusedNoiseBlock.from_block(twin)
    x = torch.randn(3, 64, 201)
    noise = torch.randn(3, 1, 201)
    fused.draw_noise = lambda t: noise
    with torch.no_grad():
        close(fused(x), x + noise * block.linear(x), torch.float32)
        conv = torch.nn.ConvTranspose1d(8, 64, 4, stride=2)  # a transposed conv whose bias it adds
        fused.take_bias_of(conv)
        xb = x + conv.bias.view(1, -1, 1)
        close(fused(x), xb + noise * block.linear(xb), torch.float32)


def test_transposed_conv_bias_moves_into_the_noise_block():
    from snac.layers import DecoderBlock

    from snac_fast.modules import BiasDeferredConvTranspose1d
    from snac_fast.surgery import fuse_decoder

    torch.manual_seed(0)
    block = DecoderBlock(128, 64, stride=4, noise=True, groups=64).eval()
    for m in block.modules():
        if hasattr(m, "alpha"):
            with torch.no_grad():
                m.alpha.uniform_(0.3, 3)
    x, noise = torch.randn(2, 128, 19), torch.randn(2, 1, 76)
    with torch.no_grad():
        conv_out = block.block[1](block.block[0](x))
        expected = block.block[5](block.block[4](block.block[3](conv_out + noise * block.block[2].linear(conv_out))))
    keys = set(block.state_dict())
    for i in (0, 3, 4, 5):
        sub = block.block[i]
        if i == 0:
            block.block[0] = FastSnake1d.from_snake(sub)
        else:
            sub.block[0] = FastSnake1d.from_snake(sub.block[0])
            sub.block[2] = FastSnake1d.from_snake(sub.block[2])
    fold_weight_norm(block)
    holder = torch.nn.Module()
    holder.decoder = torch.nn.Module()
    holder.decoder.model = torch.nn.Sequential(block)
    units, noises, deferred = fuse_decoder(holder)
    assert deferred == ["decoder.model.0.block.1"] and len(units) == 3 and len(noises) == 1
    assert isinstance(block.block[1], BiasDeferredConvTranspose1d) and block.block[2].input_bias is block.block[1].bias
    assert {k.replace("parametrizations.weight.original1", "weight") for k in keys if "original0" not in k} == set(block.state_dict())
    block.block[2].draw_noise = lambda t: noise
    with torch.no_grad():
        close(block(x), expected, torch.float32)
    block.half()  # dtype conversion keeps the link (parameters convert in place)
    assert block.block[2].input_bias is block.block[1].bias and block.block[2].input_bias.dtype == torch.float16


def test_compile_traces_through_the_ops():
    """Registered torch.library ops: dynamo captures them in one graph (fullgraph=True fails on a break)."""
    from snac_fast import snake

    def f(x, alpha, w_dw, w_pw):
        h = depthwise_conv_snake(snake(x, alpha), w_dw, None, 3, alpha)
        return pointwise_conv(h, w_pw, residual=x)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    args = (torch.randn(1, 8, 50), torch.rand(8) + 0.5, torch.randn(8, 1, 7), torch.randn(8, 8, 1))
    torch.testing.assert_close(compiled(*args), f(*args))


class _FakeGraph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def test_graph_cache_is_bounded_lru(monkeypatch):
    from snac_fast.graphs import _Captured

    def fake_capture(self, codes):
        self.captures += 1
        return _Captured(_FakeGraph(), [c.clone() for c in codes], torch.zeros(0), [], torch.zeros(1))

    monkeypatch.setattr(GraphedDecode, "_capture", fake_capture)
    runner = GraphedDecode(torch.nn.Module(), max_graphs=2)
    shapes = [(1, 4), (1, 8), (1, 4), (1, 12), (1, 8)]
    for s in shapes:
        runner([torch.zeros(s, dtype=torch.long)])
    assert len(runner) == 2 and runner.captures == 4  # (1,4) reused once; (1,8) evicted then recaptured
    assert [k[0][0] for k in runner.keys()] == [(1, 12), (1, 8)]
    out = runner([torch.zeros((1, 8), dtype=torch.long)])
    assert out is not runner._cache[runner.keys()[-1]].output  # a copy unless asked otherwise
    assert runner([torch.zeros((1, 8), dtype=torch.long)], copy_output=False) is runner._cache[runner.keys()[-1]].output
    with pytest.raises(ValueError):
        GraphedDecode(torch.nn.Module(), max_graphs=0)


def test_graphs_need_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        FastSNAC.from_pretrained("synthetic:snac_24khz", device="cpu", cuda_graphs=True)


# --- GPU --------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dilation", [1, 3, 9])
@pytest.mark.parametrize("C", CHANNELS)
def test_gpu_fused_kernels(cuda, dtype, dilation, C):
    gen = torch.Generator().manual_seed(C + dilation)
    T = 20001  # several interior tiles between the masked edge tiles
    x = torch.randn(2, C, T, generator=gen).to(dtype)
    w = (torch.randn(C, 1, 7, generator=gen) * 0.4).to(dtype)
    b = torch.randn(C, generator=gen).to(dtype)
    alpha = torch.exp(torch.empty(C).uniform_(-1.6, 1.6, generator=gen))
    got = depthwise_conv_snake(x.to(cuda), w.to(cuda), b.to(cuda), dilation, alpha.to(cuda))
    close(got.cpu(), depthwise_conv_snake_reference(x.double(), w.double(), b.double(), dilation, alpha.double()), dtype)
    wp = (torch.randn(C, C, 1, generator=gen) / C**0.5).to(dtype)
    got = pointwise_conv(x.to(cuda), wp.to(cuda), b.to(cuda), residual=x.to(cuda))
    close(got.cpu(), pointwise_conv_reference(x.double(), wp.double(), b.double(), x.double()), dtype)


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
    view = graphed.decode(codes, seed=3, reuse_output=True)
    assert graphed.decode(codes, seed=5, reuse_output=True).data_ptr() == view.data_ptr()
    for n in (4, 12, 16):  # eviction keeps at most max_graphs
        graphed.decode(random_codes(graphed.config, n), seed=0)
    assert len(graphed.graphs) == 2
    assert not torch.equal(graphed.decode(codes), graphed.decode(codes))  # no seed: fresh noise

