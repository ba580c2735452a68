"""Fused decoder kernels and modules against their unfused upstream layers; CUDA-graph cache logic."""

import shutil

import pytest
import torch
from snac.layers import DecoderBlock, NoiseBlock, ResidualUnit
from snac.vq import ResidualVectorQuantize

from helpers import random_codes
from snac_fast import FastSNAC
from snac_fast.graphs import GraphedDecode
from snac_fast.modules import (AbsorbedSnake1d, FastSnake1d, FusedConvTranspose1d, FusedNoiseBlock,
                               FusedResidualUnit)
from snac_fast.ops.codebook import codes_to_latent, codes_to_latent_reference
from snac_fast.ops.common import is_channels_last
from snac_fast.ops.conv_tanh import (TAP_GEMM_MIN_SAMPLES, _conv_tanh_by_taps, _conv_tanh_triton, conv_tanh,
                                     conv_tanh_reference, takes_tap_gemm)
from snac_fast.ops.depthwise import (_depthwise_conv_snake_triton, _dw_config, depthwise_conv_snake,
                                     depthwise_conv_snake_reference)
from snac_fast.ops.pointwise import (pointwise_conv, pointwise_conv_pair, pointwise_conv_pair_reference,
                                     pointwise_conv_reference)
from snac_fast.ops.snake import snake
from snac_fast.ops.conv_transpose import conv_transpose, conv_transpose_reference, folds_batches
from snac_fast.surgery import fold_weight_norm, fuse_decoder

# residual-unit channel counts of the three published decoders (24 kHz; 32 and 44 kHz share theirs)
CHANNELS = [512, 256, 128, 64, 768, 384, 192, 96]
# (C_in, C_out, stride) of every decoder transposed conv: 24 kHz, then 32/44 kHz
UPSAMPLERS = [(1024, 512, 8), (512, 256, 8), (256, 128, 4), (128, 64, 2),
              (1536, 768, 8), (768, 384, 8), (384, 192, 3), (192, 96, 2)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # relative to output scale


def close(got, ref, dtype):
    assert got.shape == ref.shape, (got.shape, ref.shape)
    scale = ref.abs().max().item() + 1e-6
    err = (got.double() - ref.double()).abs().max().item()
    assert err <= TOL[dtype] * scale, f"max err {err:.3g} vs scale {scale:.3g}"


def d(t):
    return None if t is None else t.double()


def log_uniform_alpha(n, gen):
    return torch.exp(torch.empty(n).uniform_(-1.6, 1.6, generator=gen))


def channels_last(t):
    """The same values [B, C, T], laid out [B, T, C] in memory."""
    out = t.transpose(1, 2).contiguous().transpose(1, 2)
    assert is_channels_last(out)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dilation", [1, 3, 9])
@pytest.mark.parametrize("C", CHANNELS)
@pytest.mark.parametrize("aligned", [False, True], ids=["odd", "multiple_of_8"])
def test_depthwise_conv_snake(dtype, dilation, C, aligned):
    """dwconv7 -> Snake in one kernel, every channel count and dilation; without bias and snake too.
    Odd lengths take the per-tap loads, multiples of 8 (but not of 16) the 16-byte chunk loads."""
    gen = torch.Generator().manual_seed(C * dilation)
    T = 37 if C >= 384 else 101  # shorter than the dilated kernel's span for C >= 384
    T = T + 3 if aligned else T
    x = torch.randn(2, C, T, generator=gen).to(dtype)
    w = (torch.randn(C, 1, 7, generator=gen) * 0.4).to(dtype)
    b = torch.randn(C, generator=gen).to(dtype)
    a = log_uniform_alpha(C, gen)
    close(depthwise_conv_snake(x, w, b, dilation, a), depthwise_conv_snake_reference(d(x), d(w), d(b), dilation, d(a)), dtype)
    close(depthwise_conv_snake(x, w, None, dilation), depthwise_conv_snake_reference(d(x), d(w), None, dilation, None), dtype)


@pytest.mark.parametrize("dilation", [1, 9])
@pytest.mark.parametrize("ragged", [0, 5])
def test_depthwise_interior_and_edge_tiles(dilation, ragged, poisoned_empty):
    """Long enough for interior tiles (unmasked loads) between the two edge tiles (masked), the last
    one ending at T or ragged."""
    T = 3 * _dw_config(2, 10**9, 3 * dilation, torch.device("cpu"))[1] + ragged
    gen = torch.Generator().manual_seed(dilation)
    x = torch.randn(1, 2, T, generator=gen)
    w = torch.randn(2, 1, 7, generator=gen)
    alpha = torch.tensor([0.7, 2.0])
    got = depthwise_conv_snake(x, w, None, dilation, alpha)
    close(got, depthwise_conv_snake_reference(d(x), d(w), None, dilation, d(alpha)), torch.float32)


@pytest.mark.parametrize("dilation", [1, 3, 9])
@pytest.mark.parametrize("config", [(1, 64, 1, 0), (2, 32, 1, 1), (1, 64, 1, 2), (4, 16, 1, 1), (1, 8, 1, 1), (2, 16, 2, 2),
                                    (4, 32, 1, 2)],
                         ids=lambda c: "rows{}_t{}_w{}_run{}".format(*c))
def test_depthwise_launch_configs(dilation, config, poisoned_empty):
    """The GPU's tile shapes, scaled down: runs of 8 and 16 outputs per thread (RUN 1, 2) and per-tap
    loads (RUN 0) on T % 8 == 0, over several tiles per row (interior and both edges) and a ragged
    last row block."""
    gen = torch.Generator().manual_seed(dilation + 10 * config[3])
    x = torch.randn(1, 5, 8 * 29, generator=gen, dtype=torch.float16)  # 232 steps: 29 chunks of 8
    w = (torch.randn(5, 1, 7, generator=gen) * 0.4).to(torch.float16)
    b = torch.randn(5, generator=gen).to(torch.float16)
    a = log_uniform_alpha(5, gen)
    got = _depthwise_conv_snake_triton(x, w, b, dilation, a, config)
    close(got, depthwise_conv_snake_reference(d(x), d(w), d(b), dilation, d(a)), torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C_in,C_out,stride", UPSAMPLERS)
def test_conv_transpose_kernel(dtype, C_in, C_out, stride):
    gen = torch.Generator().manual_seed(C_in + stride)
    T = 5 if C_in >= 768 else 19
    x = torch.randn(2, C_in, T, generator=gen).to(dtype)
    w = (torch.randn(C_in, C_out, 2 * stride, generator=gen) / (C_in * 2) ** 0.5).to(dtype)
    b = torch.randn(C_out, generator=gen).to(dtype)
    alpha = log_uniform_alpha(C_in, gen)
    close(conv_transpose(x, w, b, stride, alpha_in=alpha), conv_transpose_reference(d(x), d(w), d(b), stride, d(alpha)), dtype)
    close(conv_transpose(channels_last(x), w, None, stride), conv_transpose_reference(d(x), d(w), None, stride), dtype)


@pytest.mark.parametrize("stride", [2, 3, 4, 5, 8])
def test_conv_transpose_matches_torch_module(stride, poisoned_empty):
    """Against nn.ConvTranspose1d built with SNAC's padding rule, odd lengths, every output written
    (stride 3 and 5 use padded phases)."""
    import math

    torch.manual_seed(stride)
    conv = torch.nn.ConvTranspose1d(32, 16, 2 * stride, stride=stride, padding=math.ceil(stride / 2),
                                    output_padding=stride % 2)
    for T in (1 + 2 * stride, 131):  # batches folded into the columns, then one batch per program
        assert folds_batches(3, T) == (T < 128)
        x = torch.randn(3, 32, T)
        with torch.no_grad():
            expected = conv(x.double().float())
            for layout in (x, channels_last(x)):  # [B, C, T] and [B, T, C] memory
                close(conv_transpose(layout, conv.weight, conv.bias, stride), expected, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_tanh_kernel(dtype, poisoned_empty):
    gen = torch.Generator().manual_seed(0)
    for C_in, C_out, T in [(64, 1, 1001), (96, 1, 3), (64, 2, 50)]:
        x = torch.randn(2, C_in, T, generator=gen).to(dtype)
        w = (torch.randn(C_out, C_in, 7, generator=gen) / 8).to(dtype)
        b = torch.randn(C_out, generator=gen).to(dtype)
        ref = conv_tanh_reference(d(x), d(w), d(b))
        close(conv_tanh(x, w, b), ref, dtype)
        close(_conv_tanh_by_taps(x, w, b), ref, dtype)  # the long-input path
    x, w = torch.randn(1, 96, 300, generator=gen).to(dtype), (torch.randn(1, 96, 7, generator=gen) / 8).to(dtype)
    ref = conv_tanh_reference(d(x), d(w), None)
    close(conv_tanh(x, w), ref, dtype)  # no bias
    for config in [(32, 32, 4), (64, 64, 4)]:  # small tiles: unmasked interior tiles; a ragged channel block
        close(_conv_tanh_triton(x, w, None, config), ref, dtype)
    for block_t in (16, 64):  # taps summed across tile edges
        close(_conv_tanh_by_taps(x, w, None, block_t), ref, dtype)
    x = torch.randn(1, 24, 77, generator=gen).to(dtype)  # fewer channels than a K chunk, three outputs
    w, b = (torch.randn(3, 24, 7, generator=gen) / 4).to(dtype), torch.randn(3, generator=gen).to(dtype)
    close(_conv_tanh_by_taps(x, w, b, 32), conv_tanh_reference(d(x), d(w), d(b)), dtype)


def test_conv_tanh_path_by_length():
    x = torch.empty(4, 64, TAP_GEMM_MIN_SAMPLES // 4)
    w, wide = torch.empty(1, 64, 7), torch.empty(10, 64, 7)
    assert takes_tap_gemm(x, w) and not takes_tap_gemm(x[..., 1:], w) and not takes_tap_gemm(x, wide)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strides", [[4, 2, 1], [8, 4, 2, 1]])
def test_codes_to_latent_matches_upstream_quantizer(dtype, strides, poisoned_empty):
    torch.manual_seed(len(strides))
    rvq = ResidualVectorQuantize(96, 4096, 8, strides).eval()
    fold_weight_norm(rvq)
    codes = random_codes({"vq_strides": strides, "codebook_size": 4096}, 5, batch=3, seed=2)
    with torch.no_grad():
        expected = rvq.from_codes(codes)
        rvq.to(dtype)
        qs = rvq.quantizers
        got = codes_to_latent(codes, [q.codebook.weight for q in qs], [q.out_proj.weight for q in qs],
                              [q.out_proj.bias for q in qs], strides)
    assert got.dtype == dtype
    close(got, expected, dtype)
    ref = codes_to_latent_reference(codes, [q.codebook.weight for q in qs], [q.out_proj.weight for q in qs],
                                    [q.out_proj.bias for q in qs], strides, torch.float64)
    close(got, ref, dtype)
    args = ([q.codebook.weight for q in qs], [q.out_proj.weight for q in qs], [q.out_proj.bias for q in qs], strides)
    flag = torch.zeros(1, dtype=torch.int32)
    close(codes_to_latent(codes, *args, bad_ids=flag), ref, dtype)
    assert flag.item() == 0
    for level, bad in [(len(strides) - 1, 4096), (0, -3)]:
        wrong = [c.clone() for c in codes]
        wrong[level][1, -1] = bad
        assert torch.isfinite(codes_to_latent(wrong, *args, bad_ids=flag)).all()  # row 0 read, never out of bounds
        assert flag.item() == 1
        flag.zero_()


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
    from snac_fast.ops._runtime import GPUS, emulate_gpu

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


def test_argument_errors():
    x = torch.randn(1, 4, 10)
    w_pw = torch.randn(4, 4, 1)
    with pytest.raises(ValueError, match="K odd"):
        depthwise_conv_snake(x, torch.randn(4, 1, 6))
    with pytest.raises(ValueError, match="bias needs 4 values"):
        depthwise_conv_snake(x, torch.randn(4, 1, 7), torch.randn(3))
    with pytest.raises(ValueError, match="alpha_out needs 4 values"):
        pointwise_conv(x, w_pw, alpha_out=torch.ones(5))
    with pytest.raises(ValueError, match=r"\[C_out, 4, 1\]"):
        pointwise_conv(x, torch.randn(4, 5, 1))
    with pytest.raises(ValueError, match="residual"):
        pointwise_conv(x, w_pw, residual=torch.randn(1, 4, 9))
    with pytest.raises(ValueError, match="floating"):
        pointwise_conv(x.long(), w_pw)
    with pytest.raises(ValueError, match="must not share memory with h"):
        pointwise_conv(x, w_pw, out=x)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        pointwise_conv(x, w_pw, out=torch.empty(1, 4, 9))
    with pytest.raises(ValueError, match="snake_out must be a contiguous"):
        pointwise_conv_pair(x, w_pw, alpha=torch.ones(4), snake_out=torch.empty(1, 4, 10, dtype=torch.float64))
    with pytest.raises(ValueError, match="different tensors"):
        buf = torch.empty(1, 4, 10)
        pointwise_conv_pair(x, w_pw, alpha=torch.ones(4), out=buf, snake_out=buf)
    with pytest.raises(ValueError, match="alpha needs 4 values"):
        pointwise_conv_pair(x, w_pw, alpha=torch.ones(3))
    with pytest.raises(ValueError, match=r"weight must be \[4, C_out, 4\]"):
        conv_transpose(x, torch.randn(4, 2, 5), None, 2)
    with pytest.raises(ValueError, match="K odd"):
        conv_tanh(x, torch.randn(1, 4, 6))
    with pytest.raises(ValueError, match="latent length"):
        codes_to_latent([torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long)],
                        [torch.randn(8, 2)] * 2, [torch.randn(4, 2, 1)] * 2, [torch.randn(4)] * 2, [2, 1])


# --- modules and surgery ----------------------------------------------------------------------

def set_alphas(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if hasattr(m, "alpha"):
                m.alpha.copy_(torch.exp(torch.empty(m.alpha.shape).uniform_(-1.6, 1.6, generator=gen)))


def upstream_unit(C, dilation, seed):
    torch.manual_seed(seed)
    unit = ResidualUnit(C, dilation=dilation, groups=C).eval()
    set_alphas(unit, seed)
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
    assert set(fused.state_dict()) == {k.replace("parametrizations.weight.original1", "weight")
                                       for k in unit.state_dict() if "original0" not in k}
    x = torch.randn(2, C, 333)
    with torch.no_grad():
        close(fused(x), unit(x), torch.float32)
        # in a chain the unit gets (x, snake(x)) from the layer before and writes its result over them
        pair = (x.clone(), snake(x, fused.block[0].alpha))
        y = fused(pair)
        assert y is pair[0]
        close(y, unit(x), torch.float32)
        fused.pair_next_snake(FastSnake1d(C))
        y, s = fused((x.clone(), snake(x, fused.block[0].alpha)))
        close(y, unit(x), torch.float32)
        close(s, unit(x) + torch.sin(unit(x)) ** 2, torch.float32)  # the next snake's alpha is 1
        fused.pair_next_snake(None)
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


def test_fused_noise_block_folds_a_deferred_conv_bias():
    """After a transposed conv that leaves its bias to the NoiseBlock (cuDNN-sized outputs), the
    block adds it as a cached float32 ``W @ b`` and a residual bias; the cache follows the weights."""
    torch.manual_seed(2)
    twin = NoiseBlock(48).eval()
    fold_weight_norm(twin)
    fused = FusedNoiseBlock.from_block(twin)
    conv = FusedConvTranspose1d.from_conv(torch.nn.ConvTranspose1d(32, 48, 8, stride=4, padding=2))
    fused.follow(conv)
    conv.kernel_max_elements = 0  # every output "comes from cuDNN" without its bias
    x, noise = torch.randn(2, 48, 75), torch.randn(2, 1, 75)  # the conv's output, bias not added
    fused.draw_noise = lambda t: noise
    fused.pack()
    first = fused.folded_bias(conv.bias)
    assert first.dtype == torch.float32 and fused.folded_bias(conv.bias) is first

    def expected():
        with_bias = (x + conv.bias[:, None]).double()
        return with_bias + noise.double() * torch.nn.functional.conv1d(with_bias, fused.linear.weight.double())

    with torch.no_grad():
        close(fused(x), expected(), torch.float32)
        fused.linear.weight.mul_(2)  # an in-place change bumps the version: the fold is made again
        assert fused.folded_bias(conv.bias) is not first
        close(fused(x), expected(), torch.float32)
        conv.bias.add_(1)
        close(fused(x), expected(), torch.float32)


def standalone_decoder(*blocks):
    """A minimal object with ``decoder.model`` and a ``quantizer`` slot, as fuse_decoder walks it."""
    holder = torch.nn.Module()
    holder.quantizer = torch.nn.Identity()
    holder.decoder = torch.nn.Module()
    holder.decoder.model = torch.nn.Sequential(*blocks)
    return holder


def fast_snakes(module):
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ == "Snake1d":
                setattr(parent, name, FastSnake1d.from_snake(child))


@pytest.mark.parametrize("cudnn", [False, True])
@pytest.mark.parametrize("stride", [2, 3, 8])
def test_fused_decoder_blocks_match_upstream(stride, cudnn, monkeypatch):
    """Two DecoderBlocks in a row: the second block's input snake moves into the first block's last
    residual unit; the first block's snake into its transposed conv (nothing fused before it).
    cudnn: large-output path, transposed conv on cuDNN with its bias added by the NoiseBlock."""
    if cudnn:
        monkeypatch.setattr(FusedConvTranspose1d, "kernel_max_elements", 0)
    torch.manual_seed(stride)
    blocks = [DecoderBlock(128, 64, stride=stride, noise=True, groups=64).eval(),
              DecoderBlock(64, 32, stride=2, noise=True, groups=32).eval()]
    set_alphas(torch.nn.ModuleList(blocks), stride)
    T0 = 130 if cudnn else 11  # short inputs of several batches stay on the kernel (batches folded)
    x = torch.randn(2, 128, T0)
    T1 = T0 * stride
    noises = [torch.randn(2, 1, T1), torch.randn(2, 1, 2 * T1)]
    with torch.no_grad():
        h = x
        for block, noise in zip(blocks, noises):
            conv_out = block.block[1](block.block[0](h))
            h = conv_out + noise * block.block[2].linear(conv_out)
            h = block.block[5](block.block[4](block.block[3](h)))
        expected = h
    keys = set(torch.nn.ModuleList(blocks).state_dict())
    for block in blocks:
        fast_snakes(block)
        fold_weight_norm(block)
    holder = standalone_decoder(*blocks)
    done = fuse_decoder(holder)
    assert done["conv_transposes"] == ["decoder.model.0.block.1", "decoder.model.1.block.1"]
    assert len(done["residual_units"]) == 6 and len(done["noise_blocks"]) == 2
    units = [f"decoder.model.{b}.block.{u}.block.0" for b in (0, 1) for u in (3, 4, 5)]
    assert done["absorbed"] == ["decoder.model.0.block.0", "decoder.model.1.block.0"] + units
    first, second = blocks[0].block, blocks[1].block
    for producer, unit in [(first[2], first[3]), (first[3], first[4]), (first[4], first[5])]:
        assert producer._snake_pair is unit.block[0] and isinstance(unit.block[0], AbsorbedSnake1d)
    assert first[5]._snake_pair is None
    # the unit before the second transposed conv writes [B, T, C]; the other layers [B, C, T]
    assert [m.channels_last_out for m in first[3:]] + [m.channels_last_out for m in second[3:]] == [False, False, True] + [False] * 3
    assert isinstance(first[0], AbsorbedSnake1d) and first[0].absorbed_by == "decoder.model.0.block.1"
    assert first[1]._snake_in is first[0] and first[2]._upsampler is first[1]
    assert first[2].input_bias(torch.empty(2, 64, T1)) is (first[1].bias if cudnn else None)
    assert second[0].absorbed_by == "decoder.model.0.block.5" and first[5].alpha_out is second[0].alpha
    assert {k.replace("parametrizations.weight.original1", "weight") for k in keys if "original0" not in k} \
        == set(torch.nn.ModuleList(blocks).state_dict())
    for block, noise in zip(blocks, noises):
        block.block[2].draw_noise = lambda t, noise=noise: noise
    with torch.no_grad():
        close(holder.decoder.model(x), expected, torch.float32)


@pytest.mark.parametrize("stride", [2, 4, 8, 3])
def test_phase_packing_holds_every_tap_once(stride):
    """Even strides pack two taps per phase and no zeros; odd ones three blocks with zero taps."""
    from snac_fast.ops.conv_transpose import pack_phase_weight, splits_phases

    w = torch.arange(1, 5 * 3 * 2 * stride + 1, dtype=torch.float64).view(5, 3, 2 * stride)
    packed = pack_phase_weight(w, stride)
    assert sorted(packed[packed != 0].tolist()) == sorted(w.flatten().tolist())
    if splits_phases(stride):
        assert packed.shape == (4, 3 * stride // 2, 5) and (packed != 0).all()
    else:
        assert packed.shape == (3, 3 * 4, 5)


def test_conv_transpose_repacks_when_its_weight_changes():
    torch.manual_seed(0)
    conv = FusedConvTranspose1d.from_conv(torch.nn.ConvTranspose1d(16, 8, 4, stride=2, padding=1))
    x = torch.randn(1, 16, 9)
    with torch.no_grad():
        before = conv(x)
        conv.weight.mul_(2)  # in place, as load_state_dict does
        after = conv(x)
        close(after - conv.bias.view(1, -1, 1), 2 * (before - conv.bias.view(1, -1, 1)), torch.float32)


def test_surgery_absorbs_snakes_by_architecture():
    """24 kHz: every decoder snake runs inside a neighbour. 32 kHz: the first block's snake follows
    attention, so its transposed conv applies it."""
    for name, into_conv in [("snac_24khz", []), ("snac_32khz", ["decoder.model.3.block.0"])]:
        fast = FastSNAC.from_pretrained(f"synthetic:{name}", device="cpu")
        modules = dict(fast.model.named_modules())
        snakes = [n for n in fast.report.absorbed if isinstance(modules[n], AbsorbedSnake1d) and n.startswith("decoder.")]
        assert sum(isinstance(m, FastSnake1d) for m in fast.model.decoder.modules()) == 29
        assert len(snakes) == 17  # 4 block inputs, the output snake, the first snake of 12 residual units
        # encoder: the snake before each of the 4 strided convs, the first snake of 12 residual units
        assert sum(n.startswith("encoder.") for n in fast.report.absorbed) == 16
        assert [n for n in snakes if isinstance(modules[modules[n].absorbed_by], FusedConvTranspose1d)] == into_conv
        assert type(fast.model.decoder.model[-1]).__name__ == "AbsorbedTanh"
        assert type(fast.model.quantizer).__name__ == "FusedResidualVectorQuantize"


def test_compile_traces_through_the_ops():
    """Registered torch.library ops: dynamo captures them in one graph (fullgraph=True fails on a break)."""
    def f(x, alpha, w_dw, w_pw, w_t):
        h = depthwise_conv_snake(x, w_dw, None, 3, alpha)
        y, s = pointwise_conv_pair(h, w_pw, residual=x, alpha=alpha)
        h = depthwise_conv_snake(s, w_dw, None, 1, alpha)
        h = pointwise_conv(h, w_pw, residual=y, alpha_out=alpha, out=y)
        return conv_tanh(conv_transpose(h, w_t, None, 2, alpha_in=alpha), torch.ones(1, 4, 7))

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    args = (torch.randn(1, 8, 50), torch.rand(8) + 0.5, torch.randn(8, 1, 7), torch.randn(8, 8, 1), torch.randn(8, 4, 4))
    torch.testing.assert_close(compiled(*args), f(*args))


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="Inductor on CPU needs a C++ compiler")
def test_inductor_lowers_the_ops():
    """Inductor (not only tracing): the codebook op (its flagged twin mutates, this one does not)
    and a residual unit fed a pair, which under compile writes fresh buffers instead of over the
    pair (Inductor's reinplacing could give the in-place output h's memory)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    codes = [torch.randint(0, 16, (1, 4), generator=gen), torch.randint(0, 16, (1, 8), generator=gen)]
    tables, ws, bs = [torch.randn(16, 2, generator=gen)] * 2, [torch.randn(8, 2, 1, generator=gen)] * 2, [torch.randn(8)] * 2
    f = lambda c: codes_to_latent(c, tables, ws, bs, [2, 1])  # noqa: E731
    torch.testing.assert_close(torch.compile(f)(codes), f(codes))
    unit = upstream_unit(16, 3, seed=1)
    fused = fused_copy(unit)
    fused.pair_next_snake(FastSnake1d(16))
    x = torch.randn(1, 16, 40, generator=gen)

    def chain(x):
        return fused((x * 1.0, snake(x, fused.block[0].alpha)))

    with torch.no_grad():
        y, s = torch.compile(chain)(x)
        close(y, unit(x), torch.float32)
        close(s, snake(unit(x), torch.ones(16, dtype=torch.float64)), torch.float32)


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
    from snac_fast.graphs import _Captured

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


# --- GPU --------------------------------------------------------------------------------------

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
    from snac_fast.ops._runtime import has_tma

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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C_in,C_out,stride", UPSAMPLERS)
def test_gpu_conv_transpose_kernel(cuda, dtype, C_in, C_out, stride):
    gen = torch.Generator().manual_seed(C_in + stride)
    T = 4001 if C_in <= 256 else 301
    x = torch.randn(2, C_in, T, generator=gen).to(dtype)
    w = (torch.randn(C_in, C_out, 2 * stride, generator=gen) / (C_in * 2) ** 0.5).to(dtype)
    b = torch.randn(C_out, generator=gen).to(dtype)
    alpha = log_uniform_alpha(C_in, gen)
    got = conv_transpose(x.to(cuda), w.to(cuda), b.to(cuda), stride, alpha_in=alpha.to(cuda))
    close(got.cpu(), conv_transpose_reference(d(x), d(w), d(b), stride, d(alpha)), dtype)
    got = conv_transpose(channels_last(x).to(cuda), w.to(cuda), b.to(cuda), stride)
    close(got.cpu(), conv_transpose_reference(d(x), d(w), d(b), stride), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_output_and_codebook_kernels(cuda, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, 100003, generator=gen).to(dtype)
    w = (torch.randn(1, 64, 7, generator=gen) / 8).to(dtype)
    b = torch.randn(1, generator=gen).to(dtype)
    ref = conv_tanh_reference(d(x), d(w), d(b))
    close(conv_tanh(x.to(cuda), w.to(cuda), b.to(cuda)).cpu(), ref, dtype)  # the tap GEMM (a long input)
    close(_conv_tanh_triton(x.to(cuda), w.to(cuda), b.to(cuda)).cpu(), ref, dtype)
    strides = [8, 4, 2, 1]
    codes = random_codes({"vq_strides": strides, "codebook_size": 4096}, 301, batch=2, seed=1)
    tables = [torch.randn(4096, 8, generator=gen).to(dtype) for _ in strides]
    ws = [torch.randn(1536, 8, 1, generator=gen).to(dtype) for _ in strides]
    bs = [torch.randn(1536, generator=gen).to(dtype) for _ in strides]
    got = codes_to_latent([c.to(cuda) for c in codes], [t.to(cuda) for t in tables], [w.to(cuda) for w in ws],
                          [b.to(cuda) for b in bs], strides)
    close(got.cpu(), codes_to_latent_reference(codes, tables, ws, bs, strides, torch.float64), dtype)


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, windows", [(1, 1), (3, 3), (2, 5)])
def test_half_local_mha_matches_float64_upstream(dtype, batch, windows):
    """The 32/44 kHz LocalMHA in the model's dtype against upstream's in float64 (random, non-zero
    norm and weights), odd batch sizes and window counts; the output is poisoned-free (a new tensor)."""
    import copy

    from snac.attention import LocalMHA

    from snac_fast.modules import HalfLocalMHA

    torch.manual_seed(batch * 10 + windows)
    upstream = LocalMHA(dim=128, window_size=32, dim_head=64)
    with torch.no_grad():
        upstream.norm.weight.uniform_(0.5, 1.5)
        upstream.norm.bias.uniform_(-0.2, 0.2)
    x = torch.randn(batch, 128, 32 * windows)
    expected = copy.deepcopy(upstream).double()(x.double())
    half = HalfLocalMHA.convert(copy.deepcopy(upstream).to(dtype))
    y = half(x.to(dtype))
    assert y.dtype == dtype and torch.isfinite(y).all()
    close(y, expected, dtype)
    with pytest.raises(ValueError, match="divisible by its window 32"):
        half(x.to(dtype)[..., 1:])
    with pytest.raises(ValueError, match="upstream LocalMHA"):
        HalfLocalMHA.convert(half)


def _float64_window_attention(qkv, heads, window, cos, sin):
    """Upstream's LocalMHA core (rotate_half, apply_rotary_pos_emb, SDPA) in float64 from [B, T, 3C]."""
    from einops import rearrange
    from snac.attention import apply_rotary_pos_emb

    q, k, v = qkv.double().chunk(3, dim=-1)
    q, k, v = (rearrange(t, "b (w n) (h d) -> b h w n d", n=window, h=heads) for t in (q, k, v))
    freqs = torch.atan2(sin.double(), cos.double())
    q, k = apply_rotary_pos_emb(q, k, torch.cat((freqs, freqs), -1), torch.ones(1, dtype=torch.float64))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return rearrange(out, "b h w n d -> b (w n) (h d)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, windows, heads", [(1, 1, 2), (3, 3, 1), (2, 5, 3)])
def test_local_attention_kernel_matches_float64(dtype, batch, windows, heads):
    """The fused window-attention kernel against upstream's rotary + SDPA in float64, odd batch
    sizes, window and head counts, a strided qkv (a view into a wider buffer), the output a new
    tensor; and its errors."""
    from snac_fast.ops.attention import local_attention, local_attention_reference

    torch.manual_seed(batch * 100 + windows * 10 + heads)
    d, n = 64, 32
    wide = torch.randn(batch, n * windows, 3 * heads * d + 5, dtype=dtype)
    qkv = wide[:, :, 5:]
    angles = torch.outer(torch.arange(n, dtype=torch.float32), torch.rand(d // 2) * 2)
    cos, sin = angles.cos(), angles.sin()
    expected = _float64_window_attention(qkv, heads, n, cos, sin)
    got = local_attention(qkv, heads, n, cos, sin)
    assert got.dtype == dtype and got.shape == (batch, n * windows, heads * d) and got.is_contiguous()
    close(got, expected, dtype)
    close(local_attention_reference(qkv, heads, n, cos, sin), expected, dtype)
    with pytest.raises(ValueError, match="divisible by its window 32"):
        local_attention(qkv[:, 1:], heads, n, cos, sin)
    with pytest.raises(ValueError, match=r"cos and sin must be \[32, 32\]"):
        local_attention(qkv, heads, n, cos[:, :16], sin[:, :16])
    with pytest.raises(ValueError, match="3 \\* heads \\* d"):
        local_attention(qkv[:, :, 1:], heads, n, cos, sin)
