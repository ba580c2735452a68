"""nn.Module wrappers around the ops: drop-in replacements for upstream snac layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from snac_fast.ops.snake import snake


class FastSnake1d(nn.Module):
    """Drop-in for ``snac.layers.Snake1d``: same ``alpha`` parameter ([1, C, 1]), Triton forward.

    Input and output: [B, C, T] in the module's dtype (float16, bfloat16 or float32).
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    @classmethod
    def from_snake(cls, module: nn.Module) -> "FastSnake1d":
        """A FastSnake1d that shares ``module.alpha`` (the same Parameter object, not a copy)."""
        alpha = getattr(module, "alpha", None)
        if not isinstance(alpha, nn.Parameter) or alpha.dim() != 3 or alpha.shape[0] != 1 or alpha.shape[2] != 1:
            raise ValueError(f"expected a Snake1d with alpha shaped [1, C, 1], got {type(module).__name__}")
        fast = cls.__new__(cls)
        nn.Module.__init__(fast)
        fast.alpha = alpha
        return fast

    @property
    def channels(self) -> int:
        return self.alpha.shape[1]

    def forward(self, x: Tensor) -> Tensor:
        return snake(x, self.alpha)

    def extra_repr(self) -> str:
        return f"channels={self.channels}"


def _upstream_layers():
    from snac.layers import NoiseBlock, ResidualUnit

    return NoiseBlock, ResidualUnit


def _is_same_padding_depthwise(conv: nn.Module) -> bool:
    k, d = conv.kernel_size[0], conv.dilation[0]
    return (conv.groups == conv.in_channels == conv.out_channels and k % 2 == 1
            and conv.padding[0] == (k - 1) * d // 2 and conv.stride[0] == 1)


class FusedResidualUnit(_upstream_layers()[1]):
    """A residual unit (Snake -> dilated depthwise conv7 -> Snake -> 1x1 conv, plus x) in 3 kernels:
    snake; depthwise conv + bias + snake; 1x1 conv + bias + residual add.

    Keeps upstream's ``block`` (the same four modules, weights folded), so state-dict keys and
    module names are unchanged; ``replaces`` names the upstream layers the kernels stand for.
    Input and output: [B, C, T].
    """

    replaces = ("block.0", "block.1", "block.2", "block.3")

    def __init__(self, block: nn.Sequential) -> None:
        nn.Module.__init__(self)
        self.block = block

    @classmethod
    def fusable(cls, unit: nn.Module) -> bool:
        b = getattr(unit, "block", None)
        return (isinstance(b, nn.Sequential) and len(b) == 4 and isinstance(b[0], FastSnake1d)
                and isinstance(b[2], FastSnake1d) and isinstance(b[1], nn.Conv1d) and isinstance(b[3], nn.Conv1d)
                and _is_same_padding_depthwise(b[1]) and b[3].kernel_size[0] == 1
                and not any(hasattr(m, "parametrizations") for m in b))

    @classmethod
    def from_unit(cls, unit: nn.Module) -> "FusedResidualUnit":
        if not cls.fusable(unit):
            raise ValueError("residual unit is not fusable: needs FastSnake1d, folded weights, same-padding depthwise conv")
        return cls(unit.block)

    def forward(self, x: Tensor) -> Tensor:
        from snac_fast.ops.conv import depthwise_conv_snake, pointwise_conv

        snake1, dw, snake2, pw = self.block
        h = depthwise_conv_snake(snake1(x), dw.weight, dw.bias, dw.dilation[0], snake2.alpha)
        return pointwise_conv(h, pw.weight, pw.bias, residual=x)


class FusedNoiseBlock(_upstream_layers()[0]):
    """NoiseBlock ``x + noise * conv1x1(x)`` in one kernel (GEMM with noise-scale and residual epilogue).

    ``draw_noise(x) -> [B, 1, T]`` supplies the noise: fresh ``torch.randn`` like upstream by default;
    seeded decodes, fidelity checks and CUDA graphs replace it per instance. After
    :meth:`take_bias_of` the block computes on ``x + conv.bias`` of the preceding transposed
    convolution (see BiasDeferredConvTranspose1d).
    """

    replaces = ("linear",)

    def __init__(self, linear: nn.Conv1d) -> None:
        nn.Module.__init__(self)
        self.linear = linear
        object.__setattr__(self, "_bias_of", None)  # not a child module: the conv stays where it is

    def take_bias_of(self, conv: nn.Module) -> None:
        object.__setattr__(self, "_bias_of", conv)

    @property
    def input_bias(self) -> Tensor | None:
        return None if self._bias_of is None else self._bias_of.bias

    @classmethod
    def from_block(cls, block: nn.Module) -> "FusedNoiseBlock":
        lin = block.linear
        if not isinstance(lin, nn.Conv1d) or lin.kernel_size[0] != 1 or hasattr(lin, "parametrizations"):
            raise ValueError("NoiseBlock is not fusable: needs a folded 1x1 conv")
        return cls(lin)

    @staticmethod
    def draw_noise(x: Tensor) -> Tensor:
        return torch.randn((x.shape[0], 1, x.shape[2]), device=x.device, dtype=x.dtype)

    def forward(self, x: Tensor) -> Tensor:
        from snac_fast.ops.conv import pointwise_conv

        return pointwise_conv(x, self.linear.weight, self.linear.bias, residual=x, scale=self.draw_noise(x),
                              input_bias=self.input_bias)


class BiasDeferredConvTranspose1d(nn.ConvTranspose1d):
    """A ConvTranspose1d (cuDNN) whose bias is added by the FusedNoiseBlock after it, inside that
    block's kernel: saves a full read-and-write pass over the decoder block's largest tensor.
    Same parameters, state-dict keys and module name; its output alone lacks the bias.
    """

    bias_added_by = "the next FusedNoiseBlock"

    @classmethod
    def from_conv(cls, conv: nn.ConvTranspose1d) -> "BiasDeferredConvTranspose1d":
        if type(conv) is not nn.ConvTranspose1d or conv.bias is None or hasattr(conv, "parametrizations"):
            raise ValueError("needs a plain ConvTranspose1d with a bias and folded weights")
        deferred = cls.__new__(cls)
        deferred.__dict__.update(conv.__dict__)  # the same Parameters, hooks and conv attributes
        return deferred

    def forward(self, x: Tensor) -> Tensor:
        return F.conv_transpose1d(x, self.weight, None, self.stride, self.padding, self.output_padding,
                                  self.groups, self.dilation)
