"""Codes to latent (the quantizer's from_codes) against upstream, and the output/codebook kernels on GPU."""

import pytest
import torch
from helpers import DTYPES, close, d, random_codes
from snac.vq import ResidualVectorQuantize

from snac_fast.ops.codebook import codes_to_latent, codes_to_latent_reference
from snac_fast.ops.conv_tanh import (
    _conv_tanh_triton,
    conv_tanh,
    conv_tanh_reference,
)
from snac_fast.surgery import fold_weight_norm


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
