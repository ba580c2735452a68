"""Fused modules against the upstream layers they replace."""

import pytest
import torch
from helpers import close, fused_copy, set_alphas, upstream_unit
from snac.layers import DecoderBlock, NoiseBlock

from snac_fast.model.modules import (
    AbsorbedSnake1d,
    FastSnake1d,
    FusedConvTranspose1d,
    FusedNoiseBlock,
)
from snac_fast.model.surgery import fold_weight_norm, fuse_decoder
from snac_fast.ops.snake import snake


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
        assert producer.snake_pair is unit.block[0] and isinstance(unit.block[0], AbsorbedSnake1d)
    assert first[5].snake_pair is None
    # the unit before the second transposed conv writes [B, T, C]; the other layers [B, C, T]
    assert [m.channels_last_out for m in first[3:]] + [m.channels_last_out for m in second[3:]] == [False, False, True] + [False] * 3
    assert isinstance(first[0], AbsorbedSnake1d) and first[0].absorbed_by == "decoder.model.0.block.1"
    assert first[1].snake_in is first[0] and first[2].upsampler is first[1]
    assert first[2].input_bias(torch.empty(2, 64, T1)) is (first[1].bias if cudnn else None)
    assert second[0].absorbed_by == "decoder.model.0.block.5" and first[5].alpha_out is second[0].alpha
    assert {k.replace("parametrizations.weight.original1", "weight") for k in keys if "original0" not in k} \
        == set(torch.nn.ModuleList(blocks).state_dict())
    for block, noise in zip(blocks, noises):
        block.block[2].draw_noise = lambda t, noise=noise: noise
    with torch.no_grad():
        close(holder.decoder.model(x), expected, torch.float32)
