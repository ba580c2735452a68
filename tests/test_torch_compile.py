"""The ops under torch.compile: traced through, lowered by Inductor."""

import shutil

import pytest
import torch
from helpers import close, fused_copy, upstream_unit

from snac_fast.model.modules import (
    FastSnake1d,
)
from snac_fast.ops.codebook import codes_to_latent
from snac_fast.ops.conv_tanh import (
    conv_tanh,
)
from snac_fast.ops.conv_transpose import (
    conv_transpose,
)
from snac_fast.ops.depthwise import (
    depthwise_conv_snake,
)
from snac_fast.ops.pointwise import (
    pointwise_conv,
    pointwise_conv_pair,
)
from snac_fast.ops.snake import snake


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
