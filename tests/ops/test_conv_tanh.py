"""The decoder's output conv + tanh kernels against their torch reference."""

import pytest
import torch
from helpers import DTYPES, close, d

from snac_fast.ops.conv_tanh import (
    TAP_GEMM_MIN_SAMPLES,
    _conv_tanh_by_taps,
    _conv_tanh_triton,
    conv_tanh,
    conv_tanh_reference,
    takes_tap_gemm,
)


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
