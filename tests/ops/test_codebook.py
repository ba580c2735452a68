"""ops/codebook: codes to latent (the quantizer's from_codes) against upstream, the encoder's nearest-codeword
search and quantize against float64 and upstream float32; the output conv's kernel (ops/conv_tanh) on GPU."""

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES, NARROW, close, d, random_codes
from snac.vq import ResidualVectorQuantize

from snac_fast.ops.codebook import (
    _nearest_codeword,
    codes_to_latent,
    codes_to_latent_reference,
    nearest_codeword_reference,
    quantize,
)
from snac_fast.ops.conv_tanh import (
    _conv_tanh_triton,
    conv_tanh,
    conv_tanh_reference,
)
from snac_fast.model.surgery import fold_weight_norm
from snac_fast.model.synthetic import synthetic_model

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # of the largest |output|


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


@pytest.mark.parametrize("rows, codes, splits", [(1, 4096, 16), (37, 4096, 5), (130, 384, 3), (33, 256, 1)])
def test_nearest_codeword_matches_float64(rows, codes, splits):
    """Codebook slices across programs (splits) and rows in several blocks give the float64 argmax."""
    gen = torch.Generator().manual_seed(rows)
    e = F.normalize(torch.randn(rows, 8, generator=gen))
    table = F.normalize(torch.randn(codes, 8, generator=gen))
    assert torch.equal(_nearest_codeword(e, table, splits=splits), nearest_codeword_reference(e.double(), table.double()))


@pytest.mark.parametrize("splits", [1, 4])
def test_nearest_codeword_first_of_equal_scores(splits):
    """Codewords repeated across lanes, tiles and slices: the lowest index wins, as upstream's max."""
    gen = torch.Generator().manual_seed(7)
    table = F.normalize(torch.randn(512, 8, generator=gen))
    e = F.normalize(torch.randn(20, 8, generator=gen))
    for i, row in enumerate(e):  # row i's own codeword sits at 3 + i, 3 + i + 130 and 3 + i + 400
        for at in (3 + i + 400, 3 + i + 130, 3 + i):
            table[at] = row
    expected = torch.arange(3, 23)
    assert torch.equal(nearest_codeword_reference(e, table), expected)
    assert torch.equal(_nearest_codeword(e, table, splits=splits), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_computes_in_float32(dtype):
    """Given a half latent and half weights, the codes are upstream float32's on the same values,
    and the quantized latent is upstream's."""
    model = synthetic_model("snac_24khz", **NARROW)
    fold_weight_norm(model)
    quantizer = model.quantizer
    gen = torch.Generator().manual_seed(1)
    z = (torch.randn(2, model.latent_dim, 64, generator=gen) * 3).to(dtype)
    with torch.no_grad():
        for p in quantizer.parameters():
            p.copy_(p.to(dtype))  # upstream float32 on the half values
        expected_zq, expected = quantizer(z.float())
        qs = quantizer.quantizers
        z_q, codes = quantize(z, [q.in_proj.weight.to(dtype) for q in qs], [q.in_proj.bias.to(dtype) for q in qs],
                              [q.codebook.weight.to(dtype) for q in qs], [q.out_proj.weight.to(dtype) for q in qs],
                              [q.out_proj.bias.to(dtype) for q in qs], None, None, [q.stride for q in qs])
    assert z_q.dtype == dtype and z_q.shape == z.shape
    assert all(torch.equal(a, b) for a, b in zip(codes, expected))
    torch.testing.assert_close(z_q.float(), expected_zq, rtol=0, atol=TOLERANCE[dtype] * expected_zq.abs().max().item())


@pytest.mark.gpu
def test_gpu_nearest_codeword_slices(cuda):
    gen = torch.Generator(device=cuda).manual_seed(1)
    table = F.normalize(torch.randn(4096, 8, device=cuda, generator=gen))
    for rows in (1, 117, 15000):
        e = F.normalize(torch.randn(rows, 8, device=cuda, generator=gen))
        expected = nearest_codeword_reference(e.double(), table.double())
        assert (_nearest_codeword(e, table) == expected).float().mean().item() >= 0.999
