"""The 1x1-conv GEMM (plain, pair, TMA) against its torch reference."""

import pytest
import torch
from helpers import CHANNELS, DTYPES, channels_last, close, d, log_uniform_alpha

from snac_fast.ops.common import is_channels_last
from snac_fast.ops.depthwise import (
    depthwise_conv_snake,
    depthwise_conv_snake_reference,
)
from snac_fast.ops.pointwise import (
    pointwise_conv,
    pointwise_conv_pair,
    pointwise_conv_pair_reference,
    pointwise_conv_reference,
)
from snac_fast.ops.snake import snake


def gemm_inputs(C, T, dtype, gen):
    """h [2, C, T], a 1x1 weight [C, C, 1], a bias [C] and a residual [2, C, T], in dtype."""
    h = torch.randn(2, C, T, generator=gen).to(dtype)
    w = (torch.randn(C, C, 1, generator=gen) / C**0.5).to(dtype)
    return h, w, torch.randn(C, generator=gen).to(dtype), torch.randn(2, C, T, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", CHANNELS)
def test_pointwise_conv(dtype, C):
    gen = torch.Generator().manual_seed(C)
    T = 45
    h, w, b, res = gemm_inputs(C, T, dtype, gen)
    scale = torch.randn(2, 1, T, generator=gen).to(dtype)
    ib, a_out = torch.randn(C, generator=gen).to(dtype), log_uniform_alpha(C, gen)
    for args in [(b, res, None, None, None), (None, res, scale, None, None), (None, None, None, None, None),
                 (b, None, scale, None, a_out), (None, h, scale, ib, None), (b, None, None, ib, None), (b, res, None, None, a_out)]:
        close(pointwise_conv(h, w, *args), pointwise_conv_reference(h.double(), w.double(), *map(d, args)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pointwise_conv_folded_input_bias(dtype, poisoned_empty):
    """An input bias as the NoiseBlock keeps it: ``bias + W @ ib`` folded once (float32) into the
    GEMM's bias and ib added to the residual alone, against h + ib in float64; the same through
    ``input_bias``; misuse refused before any kernel runs."""
    from snac_fast.ops.pointwise import fold_input_bias

    gen = torch.Generator().manual_seed(11)
    C, T = 192, 53
    h, w, b, _ = gemm_inputs(C, T, dtype, gen)
    scale, ib = torch.randn(2, 1, T, generator=gen).to(dtype), torch.randn(C, generator=gen).to(dtype)
    a = log_uniform_alpha(C, gen)
    folded = fold_input_bias(w, b, ib)
    assert folded.dtype == torch.float32  # folded once in float32, whatever the GEMM's dtype
    close(folded, d(w)[:, :, 0] @ d(ib) + d(b), torch.float32)  # float32 sums of the half products
    assert fold_input_bias(w, b, None) is b
    ref_y, ref_s = pointwise_conv_pair_reference(d(h), d(w), d(b), d(h), d(scale), d(ib), alpha=d(a))
    for h_in in (h, channels_last(h)):
        y, s = pointwise_conv_pair(h_in, w, folded, h_in, scale, alpha=a, residual_bias=ib)
        close(y, ref_y, dtype)
        close(s, ref_s, dtype)
        close(pointwise_conv(h_in, w, folded, h_in, scale, residual_bias=ib), ref_y, dtype)
        close(pointwise_conv(h_in, w, b, h_in, scale, ib), ref_y, dtype)
    with pytest.raises(ValueError, match="residual_bias needs a residual"):
        pointwise_conv(h, w, folded, residual_bias=ib)
    with pytest.raises(ValueError, match="residual_bias needs a residual"):
        pointwise_conv(h, w, b, h, input_bias=ib, residual_bias=ib)
    with pytest.raises(ValueError, match="residual_bias needs 192 values"):
        pointwise_conv(h, w, folded, h, residual_bias=ib[:5])


def test_pointwise_conv_rectangular_and_poisoned(poisoned_empty):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(3, 768, 19, generator=gen)
    w = torch.randn(1024, 768, 1, generator=gen) / 28
    got = pointwise_conv(h, w)
    assert torch.isfinite(got).all()
    close(got, pointwise_conv_reference(h.double(), w.double()), torch.float32)


@pytest.mark.parametrize("config", [(16, 16, 16, 2, 3), (32, 64, 32, 4, 3)], ids=["tiles16", "tiles32x64"])
def test_pointwise_conv_program_order(config, poisoned_empty):
    """Output-channel blocks fastest (the default wherever there are several) or time tiles
    fastest: the same tiles, every one written, the same values, over ragged row and time blocks
    and several batches."""
    from snac_fast.ops.pointwise import _pointwise_conv_triton

    gen = torch.Generator().manual_seed(config[0])
    h = torch.randn(3, 40, 75, generator=gen)
    res = torch.randn(3, 72, 75, generator=gen)
    w = torch.randn(72, 40, 1, generator=gen) / 6
    b = torch.randn(72, generator=gen)
    a = log_uniform_alpha(72, gen)
    ref_y, ref_s = pointwise_conv_pair_reference(d(h), d(w), d(b), d(res), alpha=d(a))
    results = []
    for rows_fastest in (False, True):
        y, s = torch.empty_like(res), torch.empty_like(res)
        _pointwise_conv_triton(h, w, b, res, None, None, None, y, a, s, config=config, rows_fastest=rows_fastest)
        close(y, ref_y, torch.float32)
        close(s, ref_s, torch.float32)
        results.append((y, s))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", [512, 96, 64])
def test_pointwise_conv_pair_in_place(dtype, C):
    """(y, snake(y)) from one kernel, written over the residual and a spent buffer (a residual
    unit's chain); and as a NoiseBlock uses it (scale, input bias, fresh outputs)."""
    gen = torch.Generator().manual_seed(C)
    T = 77
    h, w, b, res = gemm_inputs(C, T, dtype, gen)
    a = log_uniform_alpha(C, gen)
    ref_y, ref_s = pointwise_conv_pair_reference(h.double(), w.double(), b.double(), res.double(), alpha=a.double())
    spent = torch.full_like(res, float("nan"))
    y, s = pointwise_conv_pair(h, w, b, residual=res, alpha=a, out=res, snake_out=spent)
    assert y is res and s is spent
    close(y, ref_y, dtype)
    close(s, ref_s, dtype)
    close(s, snake(ref_y, a.double()), dtype)
    x, scale, ib = h.clone(), torch.randn(2, 1, T, generator=gen).to(dtype), torch.randn(C, generator=gen).to(dtype)
    y, s = pointwise_conv_pair(x, w, b, x, scale, ib, alpha=a)
    ref_y, ref_s = pointwise_conv_pair_reference(*map(d, (x, w, b, x, scale, ib)), alpha=a.double())
    close(y, ref_y, dtype)
    close(s, ref_s, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pointwise_conv_channels_last_layouts(dtype, poisoned_empty):
    """h and residual laid out [B, T, C] (a cuDNN transposed conv's output, read by the NoiseBlock),
    and an output written that way (for the transposed conv after a block's last unit)."""
    gen = torch.Generator().manual_seed(3)
    C, T = 96, 37
    h, w, b, res = gemm_inputs(C, T, dtype, gen)
    a, ib = log_uniform_alpha(C, gen), torch.randn(C, generator=gen).to(dtype)
    scale = torch.randn(2, 1, T, generator=gen).to(dtype)
    ref = pointwise_conv_reference(d(h), d(w), d(b), d(res), alpha_out=d(a))
    for h_in, res_in in [(channels_last(h), res), (h, channels_last(res)), (channels_last(h), channels_last(res))]:
        close(pointwise_conv(h_in, w, b, res_in, alpha_out=a), ref, dtype)
    got = pointwise_conv(h, w, b, res, alpha_out=a, channels_last=True)
    assert is_channels_last(got)
    close(got, ref, dtype)
    x = channels_last(h)
    y, s = pointwise_conv_pair(x, w, b, x, scale, ib, alpha=a)
    ref_y, ref_s = pointwise_conv_pair_reference(*map(d, (h, w, b, h, scale, ib)), alpha=d(a))
    assert y.is_contiguous() and s.is_contiguous()
    close(y, ref_y, dtype)
    close(s, ref_s, dtype)
    into = channels_last(torch.empty_like(res))
    assert pointwise_conv(h, w, b, res, alpha_out=a, out=into, channels_last=True) is into
    close(into, ref, dtype)
    with pytest.raises(ValueError, match="out must be a channels-last"):
        pointwise_conv(h, w, out=torch.empty_like(res), channels_last=True)
    spent = channels_last(res)
    with pytest.raises(ValueError, match="overwrite the residual only"):
        pointwise_conv(h, w, residual=spent, out=spent.transpose(1, 2).reshape(2, C, T))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pointwise_conv_tma_kernel(dtype, poisoned_empty):
    """The TMA kernel (forced, at small tiles) against float64 over ragged row and time blocks and
    three batches: pair outputs with scale, bias and residual bias; h and residual [B, T, C]; an
    output written [B, T, C] with its snake; in place over the residual."""
    from snac_fast.ops.pointwise import _pointwise_conv_triton

    gen = torch.Generator().manual_seed(11)
    B, C_in, C_out, T = 3, 40, 72, 88
    config = (32, 32, 16, 4, 3)
    h = torch.randn(B, C_in, T, generator=gen).to(dtype)
    w = (torch.randn(C_out, C_in, 1, generator=gen) / 6).to(dtype)
    b, rb = torch.randn(C_out, generator=gen).to(dtype), torch.randn(C_out, generator=gen).to(dtype)
    res = torch.randn(B, C_out, T, generator=gen).to(dtype)
    scale = torch.randn(B, 1, T, generator=gen).to(dtype)
    a = log_uniform_alpha(C_out, gen).to(dtype)
    ref_y, ref_s = pointwise_conv_pair_reference(d(h), d(w), d(b), d(res), d(scale), alpha=d(a), residual_bias=d(rb))
    for h_in, res_in in [(h, res), (channels_last(h), channels_last(res))]:
        y, s = torch.empty_like(res), torch.empty_like(res)
        _pointwise_conv_triton(h_in, w, b, res_in, scale, rb, None, y, a, s, config=config, tma=True)
        close(y, ref_y, dtype)
        close(s, ref_s, dtype)
    ref = pointwise_conv_reference(d(h), d(w), d(b), d(res), alpha_out=d(a))
    out = torch.empty(B, T, C_out, dtype=dtype)
    _pointwise_conv_triton(h, w, b, res, None, None, a, out, out_channels_last=True, config=config, tma=True)
    close(out.transpose(1, 2), ref, dtype)
    spent = res.clone()
    _pointwise_conv_triton(h, w, b, spent, None, None, a, spent, config=config, tma=True)
    close(spent, ref, dtype)


def test_pointwise_conv_tma_rule():
    """Which calls take the TMA kernel on Hopper: half precision, 256+ output channels, problems
    large enough for the plain kernel's biggest tile, 16-byte aligned rows and bases; never on
    an sm_89 card."""
    from snac_fast.ops import pointwise
    from snac_fast.ops.device import GPUS, emulate_gpu

    def tile(B, C_out, C_in, T, dtype=torch.float16, offset=0, gpu="h100"):
        h = torch.empty(B * C_in * T + offset, dtype=dtype)[offset:].view(B, C_in, T)
        with emulate_gpu(GPUS[gpu]):  # the rules of that card, on CPU tensors
            plain = pointwise._pw_config(B, C_out, C_in, T, h.device)
            return pointwise._tma_tile(h, torch.empty(C_out, C_in, dtype=dtype), plain)

    assert tile(1, 768, 768, 39936) == (128, 128, 64, 8, 3)
    assert tile(1, 1536, 1024, 4992) == (128, 128, 64, 8, 3)
    assert tile(32, 256, 256, 1024, torch.bfloat16) == (128, 128, 64, 8, 3)
    assert tile(1, 192, 192, 958464) is None  # the plain kernel is faster below 256 channels
    assert tile(1, 768, 768, 39936, torch.float32) is None
    assert tile(1, 768, 768, 39932 + 3) is None  # rows not 16-byte aligned
    assert tile(1, 768, 768, 39936, offset=4) is None  # base not 16-byte aligned
    assert tile(1, 768, 768, 256) is None  # a B=1 streaming chunk: small tiles fill the GPU
    assert tile(1, 768, 768, 39936, gpu="rtx4090") is None  # no TMA before sm_90


def test_pointwise_conv_in_place_over_the_residual(poisoned_empty):
    gen = torch.Generator().manual_seed(5)
    h, res = torch.randn(1, 64, 50, generator=gen), torch.randn(1, 64, 50, generator=gen)
    w, a = torch.randn(64, 64, 1, generator=gen) / 8, log_uniform_alpha(64, gen)
    ref = pointwise_conv_reference(h.double(), w.double(), residual=res.double(), alpha_out=a.double())
    got = pointwise_conv(h, w, residual=res, alpha_out=a, out=res)
    assert got is res
    close(got, ref, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dilation", [1, 3, 9])
@pytest.mark.parametrize("C", CHANNELS)
def test_gpu_residual_unit_kernels(cuda, dtype, dilation, C):
    """float64 references computed on the GPU (on the CPU they took minutes)."""
    gen = torch.Generator().manual_seed(C + dilation)
    T = 20001  # several interior tiles between the edge tiles
    x = torch.randn(2, C, T, generator=gen).to(dtype).to(cuda)
    w = (torch.randn(C, 1, 7, generator=gen) * 0.4).to(dtype).to(cuda)
    b = torch.randn(C, generator=gen).to(dtype).to(cuda)
    a = log_uniform_alpha(C, gen).to(cuda)
    for length in (T, 10240):  # the last tile ragged, then ending at T
        xs = x[..., :length].contiguous()
        ref = depthwise_conv_snake_reference(d(xs), d(w), d(b), dilation, d(a))
        close(depthwise_conv_snake(xs, w, b, dilation, a), ref, dtype)
    wp = (torch.randn(C, C, 1, generator=gen) / C**0.5).to(dtype).to(cuda)
    ref = pointwise_conv_reference(d(x), d(wp), d(b), d(x), alpha_out=d(a))
    close(pointwise_conv(x, wp, b, residual=x, alpha_out=a), ref, dtype)
    x_cl = channels_last(x)  # the NoiseBlock after a cuDNN transposed conv; a unit before one
    got = pointwise_conv(x_cl, wp, b, residual=x_cl, alpha_out=a, channels_last=True)
    assert is_channels_last(got)
    close(got, ref, dtype)
    check_pair_over_the_residual(x.flip(-1).contiguous(), wp, b, x, a, dtype)


def check_pair_over_the_residual(h, w, b, x, a, dtype):
    """A residual unit's tail: (y, snake(y)) written over a copy of the residual x, against float64."""
    ref_y, ref_s = pointwise_conv_pair_reference(d(h), d(w), d(b), d(x), alpha=d(a))
    res = x.clone()
    y, s = pointwise_conv_pair(h, w, b, residual=res, alpha=a, out=res)
    assert y is res
    close(y, ref_y, dtype)
    close(s, ref_s, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("C", [1536, 768, 384, 256])
def test_gpu_pointwise_conv_tma(cuda, dtype, C):
    """Calls the launch rule gives the TMA kernel on Hopper (half precision, 256+ channels, a long
    input; the last time tile ragged) against float64 and the plain kernel: a residual unit's tail
    in place, a NoiseBlock's pair from [B, T, C] input, a block's last unit writing [B, T, C]."""
    from snac_fast.ops import pointwise
    from snac_fast.ops.launch import has_tma

    gen = torch.Generator().manual_seed(C)
    T = 16392
    x = torch.randn(2, C, T, generator=gen).to(dtype).to(cuda)
    h = torch.randn(2, C, T, generator=gen).to(dtype).to(cuda)
    w = (torch.randn(C, C, 1, generator=gen) / C**0.5).to(dtype).to(cuda)
    b = torch.randn(C, generator=gen).to(dtype).to(cuda)
    a = log_uniform_alpha(C, gen).to(cuda)
    scale = torch.randn(2, 1, T, generator=gen).to(dtype).to(cuda)
    plain = pointwise._pw_config(2, C, C, T, h.device)
    assert (pointwise._tma_tile(h, w.reshape(C, C), plain) is not None) == has_tma(x.device)
    check_pair_over_the_residual(h, w, b, x, a, dtype)
    h_cl = channels_last(h)
    ref_y, ref_s = pointwise_conv_pair_reference(d(h), d(w), d(b), d(h), d(scale), alpha=d(a))
    y, s = pointwise_conv_pair(h_cl, w, b, h_cl, scale, alpha=a)
    close(y, ref_y, dtype)
    close(s, ref_s, dtype)
    plain = torch.empty_like(y), torch.empty_like(s)
    pointwise._pointwise_conv_triton(h_cl, w, b, h_cl, scale, None, None, plain[0], a, plain[1], tma=False)
    close(y, d(plain[0]), dtype)
    close(s, d(plain[1]), dtype)
    ref = pointwise_conv_reference(d(h), d(w), d(b), d(x), alpha_out=d(a))
    got = pointwise_conv(h, w, b, x, alpha_out=a, channels_last=True)
    assert is_channels_last(got)
    close(got, ref, dtype)
