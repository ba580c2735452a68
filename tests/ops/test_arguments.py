"""Every op refuses bad arguments with a clear error before a kernel runs."""

import pytest
import torch

from snac_fast.ops.codebook import codes_to_latent
from snac_fast.ops.conv_tanh import (
    conv_tanh,
)
from snac_fast.ops.conv_transpose import (
    conv_transpose,
)
from snac_fast.ops.depthwise import depthwise_conv_snake
from snac_fast.ops.pointwise import pointwise_conv, pointwise_conv_pair


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
