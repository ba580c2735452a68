"""Building blocks shared by the convolution kernels (``depthwise``, ``pointwise``, ``conv_tanh``,
``conv_transpose``, ``dense_conv``, ``codebook``): Triton helpers for the tiles of a conv-as-GEMM
and their Snake epilogues, the references' compute dtype, memory layouts and argument checks."""

from __future__ import annotations

import torch
from torch import Tensor

from snac_fast.ops.device import HAS_TRITON
from snac_fast.ops.snake import snake_reference

if HAS_TRITON:
    import triton
    import triton.language as tl

    from snac_fast.ops.snake import SNAKE_EPS, snake_sine

    @triton.jit
    def snake_broadcast(v, alpha, STORED: tl.constexpr = tl.float32):
        """Snake of an fp32 tile with fp32 alpha shaped to broadcast over it (one per row: [R, 1, ...]).
        snake(0) = 0 keeps zero padding. STORED: the dtype the result is stored in (fp16/bf16 take
        the sine from the SFU: ops/snake ``snake_sine``)."""
        s = snake_sine(alpha * v, STORED)
        return v + (1.0 / (alpha + SNAKE_EPS)) * (s * s)

    @triton.jit
    def snake_rows(v, alpha, STORED: tl.constexpr = tl.float32):
        """Snake of an fp32 tile [R, N] with one fp32 alpha per row, stored as STORED."""
        return snake_broadcast(v, alpha[:, None], STORED)

    @triton.jit
    def program_tile(pid, n_row_blocks, n_col_blocks, ROWS_FASTEST: tl.constexpr = False):
        """(batch, row block, column block) of a program in a 1-D grid over [B, rows, columns]
        tiles, columns fastest: neighbouring programs stream neighbouring time steps. ROWS_FASTEST:
        row blocks fastest instead, so that the programs of one column tile (which all read the
        same input columns) run together and share them through L2."""
        if ROWS_FASTEST:
            row_block = pid % n_row_blocks
            rest = pid // n_row_blocks
            return rest // n_col_blocks, row_block, rest % n_col_blocks
        col_block = pid % n_col_blocks
        rest = pid // n_col_blocks
        return rest // n_row_blocks, rest % n_row_blocks, col_block

    @triton.jit
    def gemm_tile(n_m_blocks, n_t_blocks, C_out, T, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, ROWS_FASTEST: tl.constexpr = False):
        """This program's output tile of a conv-as-GEMM over [B, C_out, T]: (batch, output-channel
        offsets, time offsets, K offsets, channel mask, time mask)."""
        batch, m_block, t_block = program_tile(tl.program_id(0), n_m_blocks, n_t_blocks, ROWS_FASTEST)
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = t_block * BLOCK_N + tl.arange(0, BLOCK_N)
        return batch, offs_m, offs_n, tl.arange(0, BLOCK_K), offs_m < C_out, offs_n < T

    @triton.jit
    def store_with_pair(acc, out_ptr, pair_out_ptr, pair_alpha_ptr, out_offs, mask, offs_m, m_ok, PAIR: tl.constexpr):
        """Store the fp32 tile, and with PAIR beside it its snake (the next residual unit's input)."""
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        if PAIR:
            pair = snake_rows(acc, tl.load(pair_alpha_ptr + offs_m, mask=m_ok, other=1.0).to(tl.float32),
                               pair_out_ptr.dtype.element_ty)
            tl.store(pair_out_ptr + out_offs, pair.to(pair_out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def dot_accumulate(acc, a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
        """acc + a @ b: exact fp32 products for float32 operands (IEEE), and bf16 upcast under
        Triton's interpreter (UPCAST: numpy has no bf16, so it would multiply raw bits)."""
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE or UPCAST:
            return acc + tl.dot(a, b, input_precision="ieee")
        return acc + tl.dot(a, b)


def compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def maybe_snake(x: Tensor, alpha: Tensor | None) -> Tensor:
    return x if alpha is None else snake_reference(x, alpha)


def is_channels_last(x: Tensor) -> bool:
    """Whether x [B, C, T] is laid out as [B, T, C] in memory (``y.transpose(1, 2)`` of a contiguous
    y) and not also contiguous (one channel or one time step, where the two layouts coincide)."""
    B, C, T = x.shape
    return C > 1 and T > 1 and x.stride() == (C * T, 1, C)


def with_layout(x: Tensor) -> Tensor:
    """x for a kernel that reads [B, C, T] memory either way: a channels-last x as it is, anything
    else made contiguous."""
    return x if is_channels_last(x) else x.contiguous()


def check_floating(x: object, what: str, dims: int = 3) -> None:
    if not isinstance(x, Tensor) or x.dim() != dims or not x.dtype.is_floating_point:
        raise ValueError(f"{what} must be a floating tensor with {dims} dims, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")


def check_same_device(device: torch.device, *tensors: Tensor | None) -> None:
    if any(t is not None and t.device != device for t in tensors):
        raise ValueError(f"all tensors must be on {device}")


def check_per_channel(C: int, **vectors: Tensor | None) -> None:
    for name, v in vectors.items():
        if v is not None and v.numel() != C:
            raise ValueError(f"{name} needs {C} values (one per channel), got {v.numel()}")
