"""The 32/44 kHz decoders' and encoders' local attention in half precision (:class:`HalfLocalMHA`),
a drop-in for upstream's LocalMHA set by surgery on half models."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from snac_fast.model.modules import SnakeOut

if TYPE_CHECKING:
    from snac_fast.model.modules import FusedConvTranspose1d


def upstream_attention():
    from snac.attention import LocalMHA

    return LocalMHA


class HalfLocalMHA(SnakeOut, upstream_attention()):
    """Upstream's LocalMHA (32/44 kHz: windows of ``window_size`` steps, rotary embedding, softmax)
    in the model's half dtype, which upstream cannot run (its rotary scale makes q and k float32
    while v stays half). LayerNorm on half input (float32 statistics inside); the QKV projection a
    half GEMM (float32 accumulation); the rotation, scores, softmax and weighted sum of every
    (window, head) in one kernel (:func:`snac_fast.ops.attention.local_attention`: rotary and
    softmax in float32 registers); the output projection a GEMM whose epilogue adds the residual
    (:func:`snac_fast.ops.pointwise.pointwise_conv`) and, in the decoder, applies the next block's
    Snake1d and writes [B, T, C] memory for its transposed conv. Same parameters and module names;
    set by surgery on a half model (a class swap). Input and output: [B, C, T], T a multiple of
    ``window_size``.
    """

    def forward(self, x: Tensor) -> Tensor:
        from snac_fast.ops.attention import local_attention
        from snac_fast.ops.pointwise import pointwise_conv

        B, C, T = x.shape
        n = self.window_size
        if T % n:
            raise ValueError(f"local attention needs a length divisible by its window {n}, got {T}")
        h = F.layer_norm(x.transpose(1, 2), (C,), self.norm.weight, self.norm.bias, self.norm.eps)
        cos, sin = self._rotary_table(n, C // self.heads, x.device)
        out = local_attention(F.linear(h, self.to_qkv.weight), self.heads, n, cos, sin)  # [B, T, C]
        return pointwise_conv(out.transpose(1, 2), self.to_out.weight.unsqueeze(2), residual=x,
                              alpha_out=self.alpha_out, channels_last=self.channels_last_out)

    def _rotary_table(self, n: int, d: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """float32 cos and sin [n, d / 2] of upstream's SinusoidalEmbeddings for a window of n steps
        (which repeats them for the second half of d); without a rotary embedding, the identity."""
        key = (n, d, device)
        cached = self.__dict__.get("_rotary")
        if cached is None or cached[0] != key:
            if self.rel_pos is None:
                freqs = torch.zeros((n, d // 2), device=device)
            else:
                t = torch.arange(n, device=device, dtype=torch.float32)
                freqs = torch.outer(t, self.rel_pos.inv_freq.to(device=device, dtype=torch.float32))
            self.__dict__["_rotary"] = cached = (key, (freqs.cos(), freqs.sin()))
        return cached[1]

    @classmethod
    def convert(cls, module: nn.Module) -> "HalfLocalMHA":
        """Turn an upstream LocalMHA into this class in place (its rotary embedding without xpos)."""
        if type(module) is not upstream_attention() or getattr(module.rel_pos, "use_xpos", False):
            raise ValueError("needs an upstream LocalMHA whose rotary embedding has no xpos scale")
        module.__class__ = cls
        return module

    def take_snake_of(self, conv: "FusedConvTranspose1d", name: str) -> None:
        """Apply the snake that ``conv`` (the next layer) would run on its input, and write that
        input [B, T, C] in memory as ``conv`` reads it fastest. name: this module's qualified name."""
        snake_module, conv.snake_in = conv.snake_in, None
        snake_module.absorbed_by = name
        self.absorb_next_snake(snake_module)
        self.write_channels_last()
