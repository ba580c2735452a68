"""ops/dense_conv: the encoder's dense (strided) conv kernel against float64 conv1d."""

import pytest
import torch
import torch.nn.functional as F

from snac_fast.ops.dense_conv import dense_conv1d
from snac_fast.ops.snake import snake_reference

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # of the largest |output|


CONV_SHAPES = [(2, 1, 48, 203, 7, 1, 3), (3, 24, 48, 101, 4, 2, 1), (1, 40, 80, 77, 16, 8, 4),
               (2, 16, 32, 61, 6, 3, 2), (1, 5, 7, 9, 3, 1, 0)]


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("shape", CONV_SHAPES)
def test_dense_conv_matches_float64(shape, dtype):
    B, C_in, C_out, T, K, S, P = shape
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(B, C_in, T, generator=gen).to(dtype)
    w = (torch.randn(C_out, C_in, K, generator=gen) / (C_in * K) ** 0.5).to(dtype)
    b = torch.randn(C_out, generator=gen).to(dtype)
    alpha = (torch.rand(C_out, generator=gen) * 4 + 0.2).to(dtype)
    expected = F.conv1d(x.double(), w.double(), b.double(), S, P)  # from the rounded inputs: only the kernel's error counts
    expected_snake = snake_reference(expected, alpha.double())
    scale = expected.abs().max().item()
    channels_last = x.transpose(1, 2).contiguous().transpose(1, 2)
    for given in (x, channels_last):
        y, s = dense_conv1d(given, w, b, S, P, pair_alpha=alpha)
        assert y.dtype == s.dtype == dtype and y.is_contiguous() and s.is_contiguous()
        torch.testing.assert_close(y.double(), expected, rtol=0, atol=TOLERANCE[dtype] * scale)
        torch.testing.assert_close(s.double(), expected_snake, rtol=0, atol=TOLERANCE[dtype] * 2 * scale)
        assert torch.equal(dense_conv1d(given, w, b, S, P), y)
    torch.testing.assert_close(dense_conv1d(x, w, None, S, P).double(), expected - b.double()[:, None],
                               rtol=0, atol=TOLERANCE[dtype] * scale)


@pytest.mark.parametrize("call, message", [
    (lambda x, w: dense_conv1d(x, w[:, :3]), "weight must be"),
    (lambda x, w: dense_conv1d(x[..., :2], w), "shorter than the kernel"),
    (lambda x, w: dense_conv1d(x, w, torch.zeros(5)), "bias needs 8"),
    (lambda x, w: dense_conv1d(x, w, stride=0), "stride >= 1"),
    (lambda x, w: dense_conv1d(x.long(), w), "floating"),
])
def test_dense_conv_rejects_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.randn(1, 4, 10), torch.randn(8, 4, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_dense_conv_encoder_shapes(cuda, dtype):
    """The 24 kHz encoder's strided convs at B=2, a 10 s input's lengths, channels-last input."""
    gen = torch.Generator(device=cuda).manual_seed(0)
    for C_in, stride, T in [(48, 2, 240000), (96, 4, 120000), (192, 8, 30000), (384, 8, 3750)]:
        x = torch.randn(2, T, C_in, device=cuda, generator=gen).to(dtype).transpose(1, 2)
        w = (torch.randn(2 * C_in, C_in, 2 * stride, device=cuda, generator=gen) / (2 * stride * C_in) ** 0.5).to(dtype)
        b = torch.randn(2 * C_in, device=cuda, generator=gen).to(dtype)
        pad = -(-stride // 2)
        expected = F.conv1d(x.double(), w.double(), b.double(), stride, pad)
        y = dense_conv1d(x, w, b, stride, pad)
        torch.testing.assert_close(y.double(), expected, rtol=0, atol=TOLERANCE[dtype] * expected.abs().max().item())
