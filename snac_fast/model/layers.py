"""SNAC's layers by what they do along time, in one table (:func:`kind_of`), and the one
receptive-field rule (:func:`input_reach`): the streaming geometry, the per-layer stream states and
the encoder's chunking all switch on these, upstream's modules and the fused ones alike."""

from __future__ import annotations

import enum
import math

from torch import nn


class Kind(enum.Enum):
    BLOCK = "block"  # an encoder or decoder block, or a Sequential: its children in order
    RESIDUAL = "residual"  # a residual unit (upstream's or fused): x + its block(x)
    TRANSPOSED = "transposed"  # a transposed conv (SNAC's: kernel twice the stride)
    CONV = "conv"  # a conv (any stride, padding, dilation; 1x1 included)
    ATTENTION = "attention"  # local attention over windows
    SNAKE = "snake"  # the rest act on each time step alone
    NOISE = "noise"
    TANH = "tanh"
    IDENTITY = "identity"


PER_STEP = frozenset({Kind.SNAKE, Kind.NOISE, Kind.TANH, Kind.IDENTITY})


def kind_of(layer: nn.Module) -> Kind:
    """``layer``'s kind (a fused layer is its upstream kind; an absorbed one too: see
    :func:`is_absorbed`); ValueError for a module SNAC does not have."""
    from snac.attention import LocalMHA
    from snac.layers import DecoderBlock, EncoderBlock, NoiseBlock, ResidualUnit, Snake1d

    from snac_fast.model.modules import FastSnake1d

    for types, kind in ((LocalMHA, Kind.ATTENTION), ((DecoderBlock, EncoderBlock, nn.Sequential), Kind.BLOCK),
                        (ResidualUnit, Kind.RESIDUAL), (nn.ConvTranspose1d, Kind.TRANSPOSED), (nn.Conv1d, Kind.CONV),
                        ((Snake1d, FastSnake1d), Kind.SNAKE), (NoiseBlock, Kind.NOISE), (nn.Tanh, Kind.TANH),
                        (nn.Identity, Kind.IDENTITY)):
        if isinstance(layer, types):
            return kind
    raise ValueError(f"no SNAC layer kind for a {type(layer).__name__}")


def children_of(layer: nn.Module) -> list[nn.Module]:
    """The layers a block or residual unit runs, in order."""
    return list(layer.block if hasattr(layer, "block") else layer)


def is_absorbed(layer: nn.Module) -> bool:
    """Whether ``layer``'s computation runs inside another layer's kernel (its forward is identity:
    :class:`snac_fast.model.modules.Absorbed`); its parameters stay."""
    return bool(getattr(layer, "absorbed_by", ""))


def input_reach(layer: nn.Module, reach: int, *, streaming: bool = False) -> int:
    """Input samples ``layer`` reads on each side of a span when its outputs need ``reach`` samples
    on each side. ``streaming``: the stream's rules, a stride-1 'same'-padded conv and no attention
    (its stages take attention windows whole), else ValueError naming the layer."""
    kind = kind_of(layer)
    if kind in (Kind.BLOCK, Kind.RESIDUAL):
        for child in reversed(children_of(layer)):
            reach = input_reach(child, reach, streaming=streaming)
        return reach
    if is_absorbed(layer) or kind in PER_STEP:
        return reach
    if kind is Kind.TRANSPOSED:  # SNAC's k = 2s: output j reads inputs floor(j / s) - 1 .. + 1
        if layer.kernel_size[0] != 2 * layer.stride[0]:
            raise ValueError(f"a transposed conv of kernel {layer.kernel_size[0]} and stride {layer.stride[0]}: "
                             "SNAC's have a kernel twice the stride")
        return -(-reach // layer.stride[0]) + 1
    if kind is Kind.CONV:  # output j reads inputs j * stride - padding + [0, dilation * (kernel - 1)]
        k, d, p, s = layer.kernel_size[0], layer.dilation[0], layer.padding[0], layer.stride[0]
        if streaming and (s != 1 or 2 * p != d * (k - 1)):
            raise ValueError(f"cannot stream through {type(layer).__name__}: needs a stride-1 'same'-padded conv")
        return reach * s + max(p, d * (k - 1) - p)
    if streaming:
        raise ValueError(f"cannot stream through {type(layer).__name__} here: attention ends its stage")
    return math.ceil(reach / layer.window_size) * layer.window_size  # a window's outputs read it whole
