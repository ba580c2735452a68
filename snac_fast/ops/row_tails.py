"""Zeroing each row's steps past its own end in a zero-padded batch, for the encoder's rows-as-alone
(:func:`snac_fast.encoding.rows_as_alone`): one Triton kernel per layer output, beside its torch
reference.

The reference is four torch operations (index columns, gather, multiply, scatter) plus about seven
more to build the columns for each new length of layer output; a corpus encode ran ~110 of its ~200
launches per call there, and its launching thread was the pipeline's bottleneck
(docs/measurements.md). The kernel reads the row lengths and computes each row's end itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

from snac_fast.ops.device import HAS_TRITON, runs_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _clear_row_tails_kernel(t_ptr, lengths_ptr, C, steps, total, stride_b, stride_c, stride_t, width,
                                BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
        row = tl.program_id(0)
        end = tl.load(lengths_ptr + row).to(tl.int64) * steps // total  # the row's end at this rate
        offs_w = tl.arange(0, BLOCK_W)
        cols = end + offs_w
        col_ok = (offs_w < width) & (cols < steps)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ptrs = (t_ptr + row.to(tl.int64) * stride_b + offs_c.to(tl.int64)[:, None] * stride_c
                + cols[None, :] * stride_t)
        zeros = tl.zeros((BLOCK_C, BLOCK_W), dtype=t_ptr.dtype.element_ty)
        tl.store(ptrs, zeros, mask=(offs_c < C)[:, None] & col_ok[None, :])


def clear_row_tails_reference(t: Tensor, lengths: Tensor, total: int, width: int) -> Tensor:
    """Torch form of :func:`clear_row_tails` (gather, multiply, scatter)."""
    steps = t.shape[-1]
    ends = lengths * steps // total
    cols = (ends[:, None] + torch.arange(width, device=t.device)).clamp_(max=steps - 1)
    # a row that fills the batch has no steps past its end: its clamped columns are its own, written
    # back unchanged (every duplicate of a column writes one value)
    keep = (ends == steps).to(t.dtype)[:, None, None]
    cols = cols[:, None, :].expand(t.shape[0], t.shape[1], -1)
    return t.scatter_(2, cols, t.gather(2, cols) * keep)


def clear_row_tails(t: Tensor, lengths: Tensor, total: int, width: int) -> Tensor:
    """Set ``t[b, :, e_b : e_b + width]`` to zero in place, where ``e_b = lengths[b] * T // total``
    is row b's end at t's rate (steps past T are none). Returns ``t``.

    t: [B, C, T] float16/bfloat16/float32/float64 (any strides); lengths: int64 [B] on t's device,
    each row's length in samples of the batch's ``total``; width >= 0. No host sync: capturable in
    a CUDA graph."""
    if t.dim() != 3 or lengths.shape != (t.shape[0],):
        raise ValueError(f"need t [B, C, T] and lengths [B], got {tuple(t.shape)} and {tuple(lengths.shape)}")
    if lengths.device != t.device or lengths.dtype != torch.int64:
        raise ValueError(f"lengths must be int64 on {t.device}, got {lengths.dtype} on {lengths.device}")
    if width <= 0 or t.numel() == 0:
        return t
    if not runs_triton(t):
        return clear_row_tails_reference(t, lengths, total, width)
    B, C, T = t.shape
    block_w = triton.next_power_of_2(width)
    block_c = max(1, min(triton.next_power_of_2(C), 4096 // block_w))
    _clear_row_tails_kernel[(B, triton.cdiv(C, block_c))](t, lengths, C, T, total, *t.stride(), width,
                                                          BLOCK_C=block_c, BLOCK_W=block_w, num_warps=4)
    return t
