"""nn.Module wrappers around the ops: drop-in replacements for upstream snac layers."""

from __future__ import annotations

import torch
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
