"""The depthwise conv + Snake kernel against its torch reference."""

import pytest
import torch
from helpers import CHANNELS, DTYPES, close, d, log_uniform_alpha

from snac_fast.ops.depthwise import (
    _depthwise_conv_snake_triton,
    _dw_config,
    depthwise_conv_snake,
    depthwise_conv_snake_reference,
)


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
    """Long enough for interior tiles between the two edge tiles, the last one ending at T or ragged
    (the per-tap path skips the masks in interior tiles; the runs mask every tile)."""
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
