"""Decoder convolutions as Triton kernels, each beside its plain-torch reference.

``depthwise_conv_snake``: the residual unit's middle, ``snake(depthwise_conv(x) + bias, alpha)`` with a
dilated K-tap per-channel filter and zero padding (K-1)*dilation/2, in one pass (taps and alpha in
registers, fp32 accumulation; x is read from memory about once). Where T % 8 == 0 each thread loads
the aligned 16-byte chunks around its run of outputs once and shifts taps among its registers;
other lengths load each tap as a shifted tile (unaligned 2-byte loads, mostly L1 hits).
The unit's first snake is not computed here: inside this kernel it would be recomputed for each of
the 7 taps, which measured slower at every decoder shape, streaming chunks included (H200, e.g.
60 s, 64 channels: 600 vs 395 us per unit; README, "The kernels"). The layer before the unit
writes it instead (``pointwise_conv_pair``).

``pointwise_conv``: a 1x1 convolution as a GEMM with its epilogue fused,
``out = snake_out(residual + scale * (W @ h + bias))``, each part optional: the residual unit's tail
(conv + add, and the next layer's snake when that is absorbed) and the whole NoiseBlock
(``x + noise * (W @ x)``) are one kernel each. ``input_bias`` adds a per-channel bias to h (and to
the residual) as they are loaded: the NoiseBlock takes over the bias of a cuDNN transposed
convolution before it, which saves cuDNN's separate bias pass over the block's largest tensor.
``pointwise_conv_pair`` also stores ``snake(out)`` from the same tile: a residual unit's output and
the next unit's input snake in one kernel. Both can write in place over the residual. Inputs may be
laid out [B, C, T] or [B, T, C] in memory (``is_channels_last``: a cuDNN transposed conv's output);
``pointwise_conv(..., channels_last=True)`` writes [B, T, C] for the transposed conv after a block.

``conv_tanh``: the decoder's output layer, a "same"-padded conv1d to few channels, then tanh: one
kernel, or for long inputs two (``takes_tap_gemm``): a GEMM of every tap over aligned tiles into
float32 sums per tap, then their shifted sum and tanh.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from snac_fast.ops._runtime import (HAS_TRITON, TRITON_INTERPRET, first_filling, launch_flags, runs_triton, through_op,
                                    wave_programs)
from snac_fast.ops.snake import KERNEL_DTYPES, snake_reference

if HAS_TRITON:
    import triton
    import triton.language as tl

    from snac_fast.ops._runtime import await_previous_kernel
    from snac_fast.ops.snake import _EPS, _reduce_by_pi, _sin_reduced

    @triton.jit
    def _snake_broadcast(v, alpha):
        """Snake of an fp32 tile with fp32 alpha shaped to broadcast over it (one per row: [R, 1, ...]).
        snake(0) = 0 keeps zero padding."""
        s = _sin_reduced(_reduce_by_pi(alpha * v))
        return v + (1.0 / (alpha + _EPS)) * (s * s)

    @triton.jit
    def _snake_rows(v, alpha):
        """Snake of an fp32 tile [R, N] with one fp32 alpha per row."""
        return _snake_broadcast(v, alpha[:, None])

    @triton.jit
    def _program_tile(pid, n_row_blocks, n_col_blocks, ROWS_FASTEST: tl.constexpr = False):
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
    def _gemm_tile(n_m_blocks, n_t_blocks, C_out, T, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, ROWS_FASTEST: tl.constexpr = False):
        """This program's output tile of a conv-as-GEMM over [B, C_out, T]: (batch, output-channel
        offsets, time offsets, K offsets, channel mask, time mask)."""
        batch, m_block, t_block = _program_tile(tl.program_id(0), n_m_blocks, n_t_blocks, ROWS_FASTEST)
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = t_block * BLOCK_N + tl.arange(0, BLOCK_N)
        return batch, offs_m, offs_n, tl.arange(0, BLOCK_K), offs_m < C_out, offs_n < T

    @triton.jit
    def _store_with_pair(acc, out_ptr, pair_out_ptr, pair_alpha_ptr, out_offs, mask, offs_m, m_ok, PAIR: tl.constexpr):
        """Store the fp32 tile, and with PAIR beside it its snake (the next residual unit's input)."""
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        if PAIR:
            pair = _snake_rows(acc, tl.load(pair_alpha_ptr + offs_m, mask=m_ok, other=1.0).to(tl.float32))
            tl.store(pair_out_ptr + out_offs, pair.to(pair_out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dot_accumulate(acc, a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
        """acc + a @ b: exact fp32 products for float32 operands (IEEE), and bf16 upcast under
        Triton's interpreter (UPCAST: numpy has no bf16, so it would multiply raw bits)."""
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE or UPCAST:
            return acc + tl.dot(a, b, input_precision="ieee")
        return acc + tl.dot(a, b)

    @triton.jit
    def _lanes(v):
        """v [R, N, 8] (the last axis inside one thread) -> its 8 slices [R, N], in order: register
        renaming, no data movement."""
        R: tl.constexpr = v.shape[0]
        N: tl.constexpr = v.shape[1]
        even, odd = tl.split(tl.reshape(v, (R, N, 4, 2)))
        e04, e26 = tl.split(tl.reshape(even, (R, N, 2, 2)))
        e15, e37 = tl.split(tl.reshape(odd, (R, N, 2, 2)))
        e0, e4 = tl.split(e04)
        e2, e6 = tl.split(e26)
        e1, e5 = tl.split(e15)
        e3, e7 = tl.split(e37)
        return e0, e1, e2, e3, e4, e5, e6, e7

    @triton.jit
    def _window(lanes, START: tl.constexpr):
        """lanes[START : START + 8] (a tuple of [R, N] slices) stacked back into [R, N, 8]."""
        R: tl.constexpr = lanes[0].shape[0]
        N: tl.constexpr = lanes[0].shape[1]
        e04 = tl.join(lanes[START], lanes[START + 4])
        e26 = tl.join(lanes[START + 2], lanes[START + 6])
        e15 = tl.join(lanes[START + 1], lanes[START + 5])
        e37 = tl.join(lanes[START + 3], lanes[START + 7])
        even = tl.reshape(tl.join(e04, e26), (R, N, 4))
        odd = tl.reshape(tl.join(e15, e37), (R, N, 4))
        return tl.reshape(tl.join(even, odd), (R, N, 8))

    @triton.jit
    def _bias_snake_store(acc, bias_ptr, alpha_ptr, out_ptr, rows, cols, n_rows, C, T,
                          HAS_BIAS: tl.constexpr, SNAKE: tl.constexpr):
        """The depthwise kernel's epilogue; rows and cols shaped to broadcast over the tile (2-D or 3-D)."""
        row_ok = rows < n_rows
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows % C, mask=row_ok, other=0.0).to(tl.float32)
        if SNAKE:
            acc = _snake_broadcast(acc, tl.load(alpha_ptr + rows % C, mask=row_ok, other=1.0).to(tl.float32))
        tl.store(out_ptr + rows.to(tl.int64) * T + cols, acc.to(out_ptr.dtype.element_ty), mask=row_ok & (cols < T))

    @triton.jit
    def _depthwise_runs(x_ptr, w_ptr, bias_ptr, alpha_ptr, out_ptr, rows, runs, n_rows, C, T,
                        K: tl.constexpr, DILATION: tl.constexpr, HAS_BIAS: tl.constexpr, SNAKE: tl.constexpr,
                        MASKED: tl.constexpr, RUN: tl.constexpr):
        """A tile of rows [R] x runs [N] for T % 8 == 0: each thread computes runs of RUN aligned chunks
        of 8 outputs (``runs``: their first steps). A run's neighbourhood is loaded once, as whole
        aligned 16-byte chunks, and each tap's shift becomes a choice among registers made at compile
        time: per 8 outputs, (RUN + 2 * ceil(halo / 8)) / RUN vector loads (3 / 5 / 9 at dilation
        1 / 3 / 9 for RUN = 1), where a shifted tile load costs 8 unaligned 2-byte loads per tap."""
        HALO: tl.constexpr = (K - 1) // 2 * DILATION
        CHUNKS: tl.constexpr = (HALO + 7) // 8  # on each side of a run
        row_ok = rows < n_rows
        chan = rows % C
        row_base = tl.multiple_of(rows.to(tl.int64) * T, 8)
        pos = runs[:, None] + tl.arange(0, 8)[None, :]  # [N, 8]: each run's first chunk
        lanes = ()
        for q in tl.static_range(-CHUNKS, RUN + CHUNKS):
            src = pos + q * 8
            ptrs = x_ptr + row_base[:, None, None] + src[None, :, :]
            if MASKED:  # zero padding outside [0, T): whole chunks are in or out
                chunk = tl.load(ptrs, mask=row_ok[:, None, None] & ((src >= 0) & (src < T))[None, :, :], other=0.0)
            else:
                chunk = tl.load(ptrs)
            lanes = lanes + _lanes(chunk.to(tl.float32))
        taps = ()
        for k in tl.static_range(K):
            taps = taps + (tl.load(w_ptr + chan * K + k, mask=row_ok, other=0.0).to(tl.float32)[:, None, None],)
        for j in tl.static_range(RUN):
            acc = tl.zeros((rows.shape[0], runs.shape[0], 8), dtype=tl.float32)
            for k in tl.static_range(K):
                acc += taps[k] * _window(lanes, (k - (K - 1) // 2) * DILATION + 8 * (CHUNKS + j))
            _bias_snake_store(acc, bias_ptr, alpha_ptr, out_ptr, rows[:, None, None], (pos + 8 * j)[None, :, :],
                              n_rows, C, T, HAS_BIAS, SNAKE)

    @triton.jit
    def _depthwise_taps(x_ptr, w_ptr, row_base, chan, row_ok, cols, T,
                        K: tl.constexpr, DILATION: tl.constexpr, MASKED: tl.constexpr,
                        ROWS: tl.constexpr, BLOCK_T: tl.constexpr):
        acc = tl.zeros((ROWS, BLOCK_T), dtype=tl.float32)
        for k in tl.static_range(K):
            src = cols + (k - (K - 1) // 2) * DILATION
            w = tl.load(w_ptr + chan * K + k, mask=row_ok, other=0.0).to(tl.float32)
            if MASKED:  # tiles at the ends: zero padding outside [0, T)
                m = row_ok[:, None] & ((src >= 0) & (src < T))[None, :]
                v = tl.load(x_ptr + row_base[:, None] + src[None, :], mask=m, other=0.0).to(tl.float32)
            else:  # interior tiles: every tap in range, no mask arithmetic
                v = tl.load(x_ptr + row_base[:, None] + src[None, :]).to(tl.float32)
            acc += w[:, None] * v
        return acc

    @triton.jit
    def _depthwise_conv_snake_kernel(
        x_ptr, w_ptr, bias_ptr, alpha_ptr, out_ptr,
        n_rows, C, T, n_t_blocks,
        K: tl.constexpr, DILATION: tl.constexpr, HAS_BIAS: tl.constexpr,
        SNAKE: tl.constexpr, RUN: tl.constexpr, ROWS: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr,
    ):
        """RUN = 0: every tap a shifted tile load (any T); RUN = 1 or 2: runs of 8 or 16 outputs per
        thread from aligned chunks (T % 8 == 0, BLOCK_T a multiple of 8 * RUN)."""
        await_previous_kernel(PDL)
        pid = tl.program_id(0)
        row_block = pid // n_t_blocks
        t_block = pid - row_block * n_t_blocks
        rows = row_block * ROWS + tl.arange(0, ROWS)
        halo = (K - 1) // 2 * DILATION
        interior = (t_block * BLOCK_T >= halo) & ((t_block + 1) * BLOCK_T + halo <= T) & ((row_block + 1) * ROWS <= n_rows)
        if RUN > 0:
            runs = t_block * BLOCK_T + tl.arange(0, BLOCK_T // (8 * RUN)) * (8 * RUN)
            if interior:
                _depthwise_runs(x_ptr, w_ptr, bias_ptr, alpha_ptr, out_ptr, rows, runs, n_rows, C, T,
                                K, DILATION, HAS_BIAS, SNAKE, False, RUN)
            else:
                _depthwise_runs(x_ptr, w_ptr, bias_ptr, alpha_ptr, out_ptr, rows, runs, n_rows, C, T,
                                K, DILATION, HAS_BIAS, SNAKE, True, RUN)
        else:
            row_ok = rows < n_rows
            chan = rows % C
            row_base = rows.to(tl.int64) * T
            cols = t_block * BLOCK_T + tl.arange(0, BLOCK_T)
            if interior:
                acc = _depthwise_taps(x_ptr, w_ptr, row_base, chan, row_ok, cols, T, K, DILATION, False, ROWS, BLOCK_T)
            else:
                acc = _depthwise_taps(x_ptr, w_ptr, row_base, chan, row_ok, cols, T, K, DILATION, True, ROWS, BLOCK_T)
            _bias_snake_store(acc, bias_ptr, alpha_ptr, out_ptr, rows[:, None], cols[None, :], n_rows, C, T, HAS_BIAS, SNAKE)

    @triton.jit
    def _pointwise_conv_kernel(
        w_ptr, h_ptr, bias_ptr, res_ptr, scale_ptr, in_bias_ptr, alpha_out_ptr, out_ptr, pair_alpha_ptr, pair_out_ptr,
        C_out, C_in, T, n_m_blocks, n_t_blocks, h_stride_c, h_stride_t, res_stride_c, res_stride_t, out_stride_c, out_stride_t,
        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_IN_BIAS: tl.constexpr,
        SNAKE_OUT: tl.constexpr, PAIR: tl.constexpr, IEEE: tl.constexpr,
        UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_BLOCKS: tl.constexpr, PDL: tl.constexpr,
        ROWS_FASTEST: tl.constexpr = False,
    ):
        await_previous_kernel(PDL)
        batch, offs_m, offs_n, offs_k, m_ok, n_ok = _gemm_tile(n_m_blocks, n_t_blocks, C_out, T, BLOCK_M, BLOCK_N, BLOCK_K,
                                                               ROWS_FASTEST)
        # strides (channel, time): (T, 1) for [B, C, T] memory, (1, C) for [B, T, C] (a stride of 1 is
        # a compile-time constant to Triton, so either layout gets contiguous vector loads)
        h_base = h_ptr + batch.to(tl.int64) * C_in * T
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(K_BLOCKS):  # a layer's C_in is fixed: a compile-time trip count
            k = kb * BLOCK_K + offs_k
            k_ok = k < C_in
            a = tl.load(w_ptr + offs_m[:, None] * C_in + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(h_base + k[:, None].to(tl.int64) * h_stride_c + offs_n[None, :].to(tl.int64) * h_stride_t,
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if HAS_IN_BIAS:
                in_b = tl.load(in_bias_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
                b = tl.where(n_ok[None, :], b.to(tl.float32) + in_b[:, None], 0.0).to(b.dtype)
            acc = _dot_accumulate(acc, a, b, IEEE, UPCAST)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_m, mask=m_ok, other=0.0).to(tl.float32)[:, None]
        if HAS_SCALE:
            acc *= tl.load(scale_ptr + batch.to(tl.int64) * T + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        batch_offset = batch.to(tl.int64) * C_out * T
        out_offs = batch_offset + offs_m[:, None].to(tl.int64) * out_stride_c + offs_n[None, :].to(tl.int64) * out_stride_t
        mask = m_ok[:, None] & n_ok[None, :]
        if HAS_RES:
            res_offs = batch_offset + offs_m[:, None].to(tl.int64) * res_stride_c + offs_n[None, :].to(tl.int64) * res_stride_t
            res = tl.load(res_ptr + res_offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_IN_BIAS:
                res += tl.load(in_bias_ptr + offs_m, mask=m_ok, other=0.0).to(tl.float32)[:, None]
            acc += res
        if SNAKE_OUT:
            acc = _snake_rows(acc, tl.load(alpha_out_ptr + offs_m, mask=m_ok, other=1.0).to(tl.float32))
        _store_with_pair(acc, out_ptr, pair_out_ptr, pair_alpha_ptr, out_offs, mask, offs_m, m_ok, PAIR)

    @triton.jit
    def _conv_taps(acc, tile, w_row, ch_ok, cols, T, K: tl.constexpr, MASKED: tl.constexpr):
        """acc + sum_k w[:, k] * x[:, cols + k - K//2] for a [channels, time] tile of pointers."""
        for k in tl.static_range(K):
            w = tl.load(w_row + k, mask=ch_ok, other=0.0).to(tl.float32)
            if MASKED:  # ends of the signal (zero padding) or a ragged channel block
                src = cols + (k - (K - 1) // 2)
                v = tl.load(tile + (k - (K - 1) // 2), mask=ch_ok[:, None] & ((src >= 0) & (src < T))[None, :], other=0.0)
            else:  # interior tiles: no mask arithmetic, which bounded this kernel (integer-bound, not memory)
                v = tl.load(tile + (k - (K - 1) // 2))
            acc += w[:, None] * v.to(tl.float32)
        return acc

    @triton.jit
    def _conv_tanh_kernel(
        x_ptr, w_ptr, b_ptr, out_ptr, C_in, C_out, T, n_t_blocks,
        K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, C_BLOCKS: tl.constexpr,
        C_IN_FULL: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
    ):
        await_previous_kernel(PDL)
        batch, co, t_block = _program_tile(tl.program_id(0), C_out, n_t_blocks)
        cols = t_block * BLOCK_T + tl.arange(0, BLOCK_T)
        x_base = x_ptr + batch.to(tl.int64) * C_in * T
        halo = (K - 1) // 2
        interior = (t_block * BLOCK_T >= halo) & ((t_block + 1) * BLOCK_T + halo <= T)
        acc = tl.zeros((BLOCK_C, BLOCK_T), dtype=tl.float32)
        for cb in range(C_BLOCKS):
            ch = cb * BLOCK_C + tl.arange(0, BLOCK_C)
            ch_ok = ch < C_in
            tile = x_base + ch.to(tl.int64)[:, None] * T + cols[None, :]
            w_row = w_ptr + (co * C_in + ch) * K
            if interior and C_IN_FULL:
                acc = _conv_taps(acc, tile, w_row, ch_ok, cols, T, K, False)
            else:
                acc = _conv_taps(acc, tile, w_row, ch_ok, cols, T, K, True)
        y = tl.sum(acc, axis=0)
        if HAS_BIAS:
            y += tl.load(b_ptr + co).to(tl.float32)
        tl.store(out_ptr + (batch.to(tl.int64) * C_out + co) * T + cols, _tanh(y).to(out_ptr.dtype.element_ty), mask=cols < T)

    @triton.jit
    def _tanh(y):
        a = tl.minimum(tl.abs(y), 20.0)  # tanh(20) is 1 in float32; no overflow in exp
        t = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
        return tl.where(y < 0, -t, t)

    @triton.jit
    def _tap_sums_kernel(
        x_ptr, w_ptr, y_ptr, C_in, T, n_t_blocks, ROWS,
        K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
        C_BLOCKS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
    ):
        """y[b, o*K + k, t] = sum_c w[o, c, k] * x[b, c, t] (fp32): every tap of a conv as one GEMM
        over aligned, unshifted tiles of x. ROWS = C_out * K."""
        await_previous_kernel(PDL)
        batch, _, t_block = _program_tile(tl.program_id(0), 1, n_t_blocks)
        rows = tl.arange(0, BLOCK_R)
        cols = t_block * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok, col_ok = rows < ROWS, cols < T
        w_rows = w_ptr + (rows // K) * C_in * K + rows % K  # w [C_out, C_in, K] read as [C_out * K, C_in]
        x_base = x_ptr + batch.to(tl.int64) * C_in * T
        acc = tl.zeros((BLOCK_R, BLOCK_T), dtype=tl.float32)
        for cb in range(C_BLOCKS):
            ch = cb * BLOCK_C + tl.arange(0, BLOCK_C)
            ch_ok = ch < C_in
            a = tl.load(w_rows[:, None] + ch[None, :] * K, mask=row_ok[:, None] & ch_ok[None, :], other=0.0)
            b = tl.load(x_base + ch[:, None].to(tl.int64) * T + cols[None, :], mask=ch_ok[:, None] & col_ok[None, :], other=0.0)
            acc = _dot_accumulate(acc, a, b, IEEE, UPCAST)
        y_offs = (batch.to(tl.int64) * ROWS + rows[:, None]) * T + cols[None, :]
        tl.store(y_ptr + y_offs, acc, mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _tap_shift_tanh_kernel(y_ptr, b_ptr, out_ptr, C_out, T, n_t_blocks, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                               BLOCK_T: tl.constexpr, PDL: tl.constexpr):
        """out[b, o, t] = tanh(bias[o] + sum_k y[b, o*K + k, t + k - (K-1)/2]), zero outside [0, T)."""
        await_previous_kernel(PDL)
        row = tl.program_id(0) // n_t_blocks  # batch * C_out + o
        cols = (tl.program_id(0) % n_t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
        y_base = y_ptr + row.to(tl.int64) * K * T
        acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for k in tl.static_range(K):
            src = cols + (k - (K - 1) // 2)
            acc += tl.load(y_base + k * T + src, mask=(src >= 0) & (src < T), other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + row % C_out).to(tl.float32)
        tl.store(out_ptr + row.to(tl.int64) * T + cols, _tanh(acc).to(out_ptr.dtype.element_ty), mask=cols < T)


# --- references ---------------------------------------------------------------------------------

def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _maybe_snake(x: Tensor, alpha: Tensor | None) -> Tensor:
    return x if alpha is None else snake_reference(x, alpha)


def depthwise_conv_snake_reference(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int,
                                   alpha: Tensor | None) -> Tensor:
    """``snake(conv1d(x, weight, bias, padding=(K-1)*dilation//2, dilation, groups=C), alpha)`` in
    float32 (float64 for float64 input), returned in x's dtype. weight: [C, 1, K]."""
    compute = _compute_dtype(x)
    K = weight.shape[-1]
    y = F.conv1d(x.to(compute), weight.to(compute), None if bias is None else bias.to(compute),
                 padding=(K - 1) * dilation // 2, dilation=dilation, groups=x.shape[1])
    return _maybe_snake(y, alpha).to(x.dtype)


def _pointwise_conv_compute(h, weight, bias, residual, scale, input_bias) -> Tensor:
    compute = _compute_dtype(h)
    hc = h.to(compute)
    if input_bias is not None:
        ib = input_bias.to(compute).reshape(1, -1, 1)
        hc = hc + ib
        residual = None if residual is None else residual.to(compute) + ib
    y = F.conv1d(hc, weight.to(compute), None if bias is None else bias.to(compute))
    if scale is not None:
        y = y * scale.to(compute)
    if residual is not None:
        y = y + residual.to(compute)
    return y


def pointwise_conv_reference(h: Tensor, weight: Tensor, bias: Tensor | None = None,
                             residual: Tensor | None = None, scale: Tensor | None = None,
                             input_bias: Tensor | None = None, alpha_out: Tensor | None = None) -> Tensor:
    """``snake((residual + ib) + scale * (conv1d(h + ib, weight) + bias), alpha_out)`` in float32
    (float64 for float64 input); ib = input_bias per channel."""
    return _maybe_snake(_pointwise_conv_compute(h, weight, bias, residual, scale, input_bias), alpha_out).to(h.dtype)


def pointwise_conv_pair_reference(h: Tensor, weight: Tensor, bias: Tensor | None = None,
                                  residual: Tensor | None = None, scale: Tensor | None = None,
                                  input_bias: Tensor | None = None, *, alpha: Tensor) -> tuple[Tensor, Tensor]:
    """(y, snake(y, alpha)) for y = :func:`pointwise_conv_reference` (no alpha_out); the snake is
    taken of the unrounded float32 (float64) y."""
    y = _pointwise_conv_compute(h, weight, bias, residual, scale, input_bias)
    return y.to(h.dtype), snake_reference(y, alpha).to(h.dtype)


def conv_tanh_reference(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``tanh(conv1d(x, weight, bias, padding=(K-1)//2))`` in float32 (float64 for float64 input)."""
    compute = _compute_dtype(x)
    y = F.conv1d(x.to(compute), weight.to(compute), None if bias is None else bias.to(compute),
                 padding=(weight.shape[-1] - 1) // 2)
    return torch.tanh(y).to(x.dtype)


# --- launchers ----------------------------------------------------------------------------------

def _block_k(C_in: int) -> int:
    """The largest power of two <= 64 that divides C_in (no ragged chunk), at least 16 (tl.dot)."""
    block = 64
    while block > 16 and C_in % block:
        block //= 2
    return block


def _dw_config(n_rows: int, T: int, halo: int, device: torch.device) -> tuple[int, int, int, int]:
    """(ROWS, BLOCK_T, num_warps, RUN) for the depthwise kernel over [n_rows, T] with a tap reach of
    ``halo`` steps each side, as measured fastest on an H200 at the 24 kHz decoder's shapes (a sweep
    of rows, length, warps and run length; scripts/tune_tiles.py --only dw covers the same configs).
    T % 8 == 0 (every decoder layer after the first) takes runs of aligned chunks: on a small grid,
    tiles of up to 2048 outputs, 8 per thread, at least a wave of programs; rows up to 4096 steps
    as one tile each, 16 outputs per thread, in runs of 16 where the halo spans more than two
    chunks (dilation 9); longer rows in 2048-step tiles of 32 outputs per thread. Other T: per-tap loads (RUN = 0), 512-element tiles of one warp, or of
    four while the grid is small."""
    if TRITON_INTERPRET:  # few, big programs of per-tap loads: the interpreter pays per program and per
        # op (the runs' register shuffles cost it 15-40% more); tests cover the runs with explicit configs
        block_t = min(triton.next_power_of_2(T), 1 << 16)
        rows = min(triton.next_power_of_2(n_rows), max(1, (1 << 16) // block_t))
        return rows, block_t, 4, 0
    waves = wave_programs(device)
    if T % 8:
        block_t = min(triton.next_power_of_2(T), 512)
        rows = min(triton.next_power_of_2(n_rows), 512 // block_t)
        programs = triton.cdiv(n_rows, rows) * triton.cdiv(T, block_t)
        return rows, block_t, 1 if programs >= 8 * waves else 4, 0
    if n_rows * T < 8 * waves * 1024:
        elements = max(256, min(2048, 1 << (max(1, n_rows * T // waves).bit_length() - 1)))
        per_thread, run = 8, 1
    elif T <= 4096:
        elements, per_thread, run = max(512, triton.next_power_of_2(T)), 16, 2 if halo > 16 and T > 8 else 1
    else:
        elements, per_thread, run = 2048, 32, 1
    block_t = min(triton.next_power_of_2(T), elements)
    rows = min(triton.next_power_of_2(n_rows), elements // block_t)
    return rows, block_t, max(1, rows * block_t // (32 * per_thread)), run


def _depthwise_conv_snake_triton(x, weight, bias, dilation, alpha, config=None):
    """config: (ROWS, BLOCK_T, num_warps, RUN), as _dw_config returns; RUN > 0 needs T % 8 == 0 and
    BLOCK_T a multiple of 8 * RUN."""
    B, C, T = x.shape
    out = torch.empty((B, C, T), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x = x.contiguous()
    K = weight.shape[-1]
    rows, block_t, warps, run = config or _dw_config(B * C, T, (K - 1) // 2 * dilation, x.device)
    n_t_blocks = triton.cdiv(T, block_t)
    grid = (triton.cdiv(B * C, rows) * n_t_blocks,)
    w = weight.reshape(C, K)
    flat = lambda t: w if t is None else t.reshape(-1)  # noqa: E731 - an unused pointer slot
    _depthwise_conv_snake_kernel[grid](
        x, w, flat(bias), flat(alpha), out,
        B * C, C, T, n_t_blocks,
        K=K, DILATION=dilation, HAS_BIAS=bias is not None, SNAKE=alpha is not None,
        RUN=run, ROWS=rows, BLOCK_T=block_t, num_warps=warps, **launch_flags(x.device, grid[0]),
    )
    return out


# (BLOCK_M, BLOCK_N) in order of preference; small problems take the first that fills the GPU
_PW_TILES = ((64, 128), (64, 64), (64, 32), (64, 16), (32, 16), (16, 16))


def _pw_config(B: int, C_out: int, C_in: int, T: int, device: torch.device,
               input_bias: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Long inputs and batches: 64 x 128 tiles,
    and the whole of C_in <= 128 in one K step (the GEMM is bandwidth-bound there: on an H200 at a
    B=32 chunk, 128 channels, 43 us against 54 us for 128 x 128 tiles in 64-deep steps; the whole
    decode 0.99 against 1.05 ms). Streaming chunks: the biggest tile that still gives every SM a
    program, and 128-deep K steps for the narrow ones (fewer serial iterations); 2-4x faster than
    one big tile at those shapes (scripts/tune_tiles.py). With ``input_bias`` over several K steps
    (a NoiseBlock after a cuDNN transposed conv, C_in > 128) every M block adds the bias to its h
    tiles in registers: 128 x 64 tiles halve that work (H200: 256 channels, B=32 chunk 40 -> 34 us,
    60 s 211 -> 166 us; 512 channels 19 -> 14 and 75 -> 61 us)."""
    if TRITON_INTERPRET:
        return (max(16, min(128, triton.next_power_of_2(C_out))), max(16, min(1024, triton.next_power_of_2(T))),
                max(16, min(64, triton.next_power_of_2(C_in))), 4, 3)
    cap_m, cap_n = max(16, triton.next_power_of_2(C_out)), max(16, triton.next_power_of_2(T))
    preferred = ((128, 64),) if input_bias and C_in > 128 else ()
    tiles = [(min(m, cap_m), min(n, cap_n)) for m, n in preferred + _PW_TILES]
    block_m, block_n = first_filling(tiles, lambda t: B * triton.cdiv(C_out, t[0]) * triton.cdiv(T, t[1]),
                                     wave_programs(device))
    if C_in <= 128:  # the whole reduction in one K step
        block_k = max(16, triton.next_power_of_2(C_in))
    else:
        block_k = 128 if C_in >= 512 and block_n <= 32 else 64
    return block_m, block_n, block_k, 2 if block_m * block_n <= 512 else 4, 3


def is_channels_last(x: Tensor) -> bool:
    """Whether x [B, C, T] is laid out as [B, T, C] in memory (``y.transpose(1, 2)`` of a contiguous
    y) and not also contiguous (one channel or one time step, where the two layouts coincide)."""
    B, C, T = x.shape
    return C > 1 and T > 1 and x.stride() == (C * T, 1, C)


def _with_layout(x: Tensor) -> tuple[Tensor, int, int]:
    """(x, channel stride, time stride) for a kernel that reads [B, C, T] either way: a
    channels-last x as it is, anything else made contiguous."""
    if not is_channels_last(x):
        x = x.contiguous()
    return x, x.stride(1), x.stride(2)


def _pointwise_conv_triton(h, weight, bias, residual, scale, input_bias, alpha_out, out,
                           pair_alpha=None, pair_out=None, out_channels_last=False, config=None, rows_fastest=None):
    """Writes into out (and pair_out, in out's layout): [B, C_out, T], or [B, T, C_out] when
    ``out_channels_last``. out may be residual itself in the same layout (each element is read
    before it is written, by the same program). h and residual: contiguous or channels-last."""
    B, C_in, T = h.shape
    C_out = weight.shape[0]
    if out.numel() == 0:
        return
    h, h_stride_c, h_stride_t = _with_layout(h)
    w = weight.reshape(C_out, C_in).contiguous()
    residual, res_stride_c, res_stride_t = (None, 0, 0) if residual is None else _with_layout(residual)
    out_stride_c, out_stride_t = (1, C_out) if out_channels_last else (T, 1)
    scale = None if scale is None else scale.contiguous()
    block_m, block_n, block_k, warps, stages = config or _pw_config(B, C_out, C_in, T, h.device, input_bias is not None)
    n_m, n_t = triton.cdiv(C_out, block_m), triton.cdiv(T, block_n)
    if rows_fastest is None:
        # the output-channel blocks of one time tile run together, so h's columns come from HBM once
        # (H100, fp16, 60 s: the 32 kHz units' GEMMs 1.85 -> 1.36 ms, 24 kHz 0.98 -> 0.86 ms; chunks
        # within +-5%; scripts/tune_tiles.py --only pw-order)
        rows_fastest = n_m > 1
    flat = lambda t: w if t is None else t.reshape(-1)  # noqa: E731 - an unused pointer slot
    _pointwise_conv_kernel[(B * n_m * n_t,)](
        w, h, flat(bias), out if residual is None else residual, out if scale is None else scale,
        flat(input_bias), flat(alpha_out), out, flat(pair_alpha), out if pair_out is None else pair_out,
        C_out, C_in, T, n_m, n_t, h_stride_c, h_stride_t, res_stride_c, res_stride_t, out_stride_c, out_stride_t,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, HAS_SCALE=scale is not None,
        HAS_IN_BIAS=input_bias is not None, SNAKE_OUT=alpha_out is not None, PAIR=pair_out is not None,
        IEEE=h.dtype == torch.float32, UPCAST=TRITON_INTERPRET and h.dtype == torch.bfloat16,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, K_BLOCKS=triton.cdiv(C_in, block_k), ROWS_FASTEST=rows_fastest,
        num_warps=warps, num_stages=stages, **launch_flags(h.device, B * n_m * n_t),
    )


# (BLOCK_C, BLOCK_T): 4,096-element tiles, shorter in time while the grid is small
_TANH_TILES = ((16, 256), (32, 128), (64, 64), (64, 32))


def _conv_tanh_config(rows: int, T: int, device: torch.device) -> tuple[int, int, int]:
    if TRITON_INTERPRET:
        return 64, 4096, 4
    block_c, block_t = first_filling(_TANH_TILES, lambda t: rows * triton.cdiv(T, t[1]), wave_programs(device))
    return block_c, block_t, 4


def _conv_tanh_triton(x, weight, bias, config=None):
    B, C_in, T = x.shape
    C_out, _, K = weight.shape
    out = torch.empty((B, C_out, T), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x = x.contiguous()
    block_c, block_t, warps = config or _conv_tanh_config(B * C_out, T, x.device)
    block_c = min(triton.next_power_of_2(C_in), block_c)
    block_t = min(triton.next_power_of_2(T), block_t)
    n_t = triton.cdiv(T, block_t)
    _conv_tanh_kernel[(B * C_out * n_t,)](
        x, weight.contiguous(), weight if bias is None else bias, out, C_in, C_out, T, n_t,
        K=K, BLOCK_C=block_c, BLOCK_T=block_t, C_BLOCKS=triton.cdiv(C_in, block_c), C_IN_FULL=C_in % block_c == 0, HAS_BIAS=bias is not None,
        num_warps=warps, **launch_flags(x.device, B * C_out * n_t),
    )
    return out


def _conv_tanh_by_taps(x, weight, bias, block_t=None):
    """:func:`conv_tanh` in two kernels: all taps as one GEMM over unshifted tiles of x into float32
    sums per tap [B, C_out * K, T], then the shifted sum of those and tanh. The one-kernel form loads
    every element of x K times at shifted, unaligned addresses, which bounds it on long inputs."""
    B, C_in, T = x.shape
    C_out, _, K = weight.shape
    out = torch.empty((B, C_out, T), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x = x.contiguous()
    rows = C_out * K
    taps = torch.empty((B, rows, T), dtype=torch.float32, device=x.device)
    block_c = max(16, min(64, triton.next_power_of_2(C_in)))
    block_t = min(max(16, triton.next_power_of_2(T)), block_t or (4096 if TRITON_INTERPRET else 128))
    n_t = triton.cdiv(T, block_t)
    _tap_sums_kernel[(B * n_t,)](
        x, weight.contiguous(), taps, C_in, T, n_t, rows,
        K=K, BLOCK_R=max(16, triton.next_power_of_2(rows)), BLOCK_C=block_c, BLOCK_T=block_t,
        C_BLOCKS=triton.cdiv(C_in, block_c), IEEE=x.dtype == torch.float32,
        UPCAST=TRITON_INTERPRET and x.dtype == torch.bfloat16, num_warps=4, **launch_flags(x.device, B * n_t),
    )
    block_t = min(triton.next_power_of_2(T), 1024)
    n_t = triton.cdiv(T, block_t)
    _tap_shift_tanh_kernel[(B * C_out * n_t,)](
        taps, weight if bias is None else bias, out, C_out, T, n_t, K=K, HAS_BIAS=bias is not None,
        BLOCK_T=block_t, num_warps=4, **launch_flags(x.device, B * C_out * n_t),
    )
    return out


TAP_GEMM_MIN_SAMPLES = 1 << 16


def takes_tap_gemm(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`conv_tanh` of x [B, C_in, T] with weight [C_out, C_in, K] runs as the two-kernel
    tap GEMM: long inputs (B * T samples), few output taps (C_out * K)."""
    B, _, T = x.shape
    C_out, _, K = weight.shape
    return B * T >= TAP_GEMM_MIN_SAMPLES and C_out * K <= 64


def _kernel_applies(x: Tensor) -> bool:
    return x.dtype in KERNEL_DTYPES and runs_triton(x)


# --- torch.library ops (what torch.compile sees; plain inference calls their bodies) and the public functions ---

def _depthwise_conv_snake(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int,
                          alpha: Tensor | None) -> Tensor:
    if _kernel_applies(x):
        return _depthwise_conv_snake_triton(x, weight, bias, dilation, alpha)
    return depthwise_conv_snake_reference(x, weight, bias, dilation, alpha).contiguous()


_depthwise_conv_snake_op = torch.library.custom_op("snac_fast::depthwise_conv_snake", _depthwise_conv_snake,
                                                   mutates_args=())


@_depthwise_conv_snake_op.register_fake
def _(x, weight, bias, dilation, alpha):
    return x.new_empty(x.shape)


def _pointwise_conv(h: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None,
                       scale: Tensor | None, input_bias: Tensor | None, alpha_out: Tensor | None, out: Tensor,
                       pair_alpha: Tensor | None, pair_out: Tensor | None, out_channels_last: bool) -> None:
    """out (and pair_out): contiguous [B, C_out, T], or contiguous [B, T, C_out] when
    ``out_channels_last`` (a flag, not a transposed view: mutated arguments stay plain tensors)."""
    # here, not in the wrappers: torch.compile runs an op's body as it is, without tracing it
    storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    if storage(out) == storage(h) or pair_out is not None and storage(pair_out) == storage(h):
        raise ValueError("out and snake_out must not share memory with h: the GEMM reads all of h's channels")
    if pair_out is not None and storage(pair_out) == storage(out):
        raise ValueError("out and snake_out must be different tensors")
    if residual is not None and storage(out) == storage(residual) and (out_channels_last or not residual.is_contiguous()):
        raise ValueError("out may overwrite the residual only when both are contiguous [B, C, T]")
    if _kernel_applies(h):
        _pointwise_conv_triton(h, weight, bias, residual, scale, input_bias, alpha_out, out, pair_alpha, pair_out,
                               out_channels_last)
        return
    if pair_out is None:
        results = [(out, pointwise_conv_reference(h, weight, bias, residual, scale, input_bias, alpha_out))]
    else:
        y, pair = pointwise_conv_pair_reference(h, weight, bias, residual, scale, input_bias, alpha=pair_alpha)
        results = [(out, y), (pair_out, pair)]
    for dest, value in results:
        dest.copy_(value.transpose(1, 2) if out_channels_last else value)


_pointwise_conv_op = torch.library.custom_op("snac_fast::pointwise_conv", _pointwise_conv, mutates_args=("out", "pair_out"))


@_pointwise_conv_op.register_fake
def _(h, weight, bias, residual, scale, input_bias, alpha_out, out, pair_alpha, pair_out, out_channels_last):
    return None


def _conv_tanh(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if _kernel_applies(x):
        if takes_tap_gemm(x, weight):
            return _conv_tanh_by_taps(x, weight, bias)
        return _conv_tanh_triton(x, weight, bias)
    return conv_tanh_reference(x, weight, bias).contiguous()


_conv_tanh_op = torch.library.custom_op("snac_fast::conv_tanh", _conv_tanh, mutates_args=())


@_conv_tanh_op.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0], x.shape[2]))


def check_floating(x: object, what: str, dims: int = 3) -> None:
    if not isinstance(x, Tensor) or x.dim() != dims or not x.dtype.is_floating_point:
        raise ValueError(f"{what} must be a floating tensor with {dims} dims, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")


def check_same_device(device: torch.device, *tensors: Tensor | None) -> None:
    if any(t is not None and t.device != device for t in tensors):
        raise ValueError(f"all tensors must be on {device}")


def _check_per_channel(C: int, **vectors: Tensor | None) -> None:
    for name, v in vectors.items():
        if v is not None and v.numel() != C:
            raise ValueError(f"{name} needs {C} values (one per channel), got {v.numel()}")


def depthwise_conv_snake(x: Tensor, weight: Tensor, bias: Tensor | None = None, dilation: int = 1,
                         alpha: Tensor | None = None) -> Tensor:
    """Dilated depthwise conv1d ("same" zero padding) + bias, then Snake with ``alpha`` if given.

    x: [B, C, T]; weight: [C, 1, K] with K odd; bias, alpha: [C] (alpha also [1, C, 1]).
    Returns [B, C, T] contiguous in x's dtype. Inference only (no autograd).
    """
    check_floating(x, "x")
    check_floating(weight, "weight")
    C = x.shape[1]
    if weight.shape[0] != C or weight.shape[1] != 1 or weight.shape[2] % 2 == 0:
        raise ValueError(f"depthwise weight must be [{C}, 1, K] with K odd, got {tuple(weight.shape)}")
    _check_per_channel(C, bias=bias, alpha=alpha)
    if dilation < 1:
        raise ValueError(f"dilation must be >= 1, got {dilation}")
    check_same_device(x.device, weight, bias, alpha)
    run = _depthwise_conv_snake_op if through_op(x, weight, bias, alpha) else _depthwise_conv_snake
    return run(x, weight, bias, int(dilation), alpha)


def _check_pointwise(h, weight, bias, residual, scale, input_bias, **alphas: Tensor | None) -> None:
    check_floating(h, "h")
    check_floating(weight, "weight")
    B, C_in, T = h.shape
    C_out = weight.shape[0]
    if weight.shape[1:] != (C_in, 1):
        raise ValueError(f"pointwise weight must be [C_out, {C_in}, 1], got {tuple(weight.shape)}")
    if residual is not None and tuple(residual.shape) != (B, C_out, T):
        raise ValueError(f"residual must be {(B, C_out, T)}, got {tuple(residual.shape)}")
    if scale is not None and tuple(scale.shape) != (B, 1, T):
        raise ValueError(f"scale must be {(B, 1, T)}, got {tuple(scale.shape)}")
    _check_per_channel(C_out, bias=bias, **alphas)
    _check_per_channel(C_in, input_bias=input_bias)
    if input_bias is not None and residual is not None and C_in != C_out:
        raise ValueError("input_bias with a residual needs C_in == C_out")
    check_same_device(h.device, weight, bias, residual, scale, input_bias, *alphas.values())


def _output_buffer(out: Tensor | None, h: Tensor, C_out: int, what: str, channels_last: bool = False) -> Tensor:
    """``out`` checked as a destination for a [B, C_out, T] result of h (contiguous, or channels-last
    when asked), or a new one."""
    B, _, T = h.shape
    if out is None:
        return h.new_empty((B, T, C_out)).transpose(1, 2) if channels_last else h.new_empty((B, C_out, T))
    layout_ok = is_channels_last(out) or out.is_contiguous() and (C_out == 1 or T == 1) if channels_last else out.is_contiguous()
    if tuple(out.shape) != (B, C_out, T) or out.dtype != h.dtype or out.device != h.device or not layout_ok:
        layout = "channels-last" if channels_last else "contiguous"
        raise ValueError(f"{what} must be a {layout} {h.dtype} tensor {(B, C_out, T)} on {h.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def pointwise_conv(h: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None,
                   scale: Tensor | None = None, input_bias: Tensor | None = None,
                   alpha_out: Tensor | None = None, *, out: Tensor | None = None,
                   channels_last: bool = False) -> Tensor:
    """``snake(residual + scale * (W @ h + bias), alpha_out)``: a 1x1 conv with its epilogue fused.

    h: [B, C_in, T]; weight: [C_out, C_in, 1]; bias, alpha_out: [C_out]; residual: [B, C_out, T];
    scale: [B, 1, T]; input_bias: [C_in], added to h and to the residual as they are loaded (needs
    C_in == C_out when a residual is given). h and residual may be contiguous or channels-last
    (:func:`is_channels_last`). Returns [B, C_out, T] in h's dtype: contiguous, or with
    ``channels_last`` laid out [B, T, C_out] in memory (the layout a transposed conv reads fastest).
    out: where to write, in that layout; a contiguous out may be the residual itself (an in-place
    update); never h. Inference only.
    """
    _check_pointwise(h, weight, bias, residual, scale, input_bias, alpha_out=alpha_out)
    out = _output_buffer(out, h, weight.shape[0], "out", channels_last)
    # the op takes the [B, T, C_out] tensor itself: mutated arguments stay plain contiguous tensors
    run = _pointwise_conv_op if through_op(h, weight, bias, residual, scale, input_bias, alpha_out) else _pointwise_conv
    run(h, weight, bias, residual, scale, input_bias, alpha_out, out.transpose(1, 2) if channels_last else out,
        None, None, channels_last)
    return out


def pointwise_conv_pair(h: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None,
                        scale: Tensor | None = None, input_bias: Tensor | None = None, *, alpha: Tensor,
                        out: Tensor | None = None, snake_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(y, snake(y, alpha)) with y = :func:`pointwise_conv` (no alpha_out), both from one kernel:
    a residual unit's output and the next unit's input snake. out and snake_out: destinations (the
    same rules as :func:`pointwise_conv`'s out; snake_out may be any tensor no longer needed)."""
    _check_pointwise(h, weight, bias, residual, scale, input_bias, alpha=alpha)
    out = _output_buffer(out, h, weight.shape[0], "out")
    snake_out = _output_buffer(snake_out, h, weight.shape[0], "snake_out")
    run = _pointwise_conv_op if through_op(h, weight, bias, residual, scale, input_bias, alpha) else _pointwise_conv
    run(h, weight, bias, residual, scale, input_bias, None, out, alpha, snake_out, False)
    return out, snake_out


def conv_tanh(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``tanh(conv1d(x, weight, bias))`` with "same" zero padding (K-1)/2, stride 1: the decoder's
    output layer. x: [B, C_in, T]; weight: [C_out, C_in, K], K odd; bias: [C_out]. Returns
    [B, C_out, T] in x's dtype. Meant for few output channels (SNAC has one): one program per
    (batch, output channel, time tile); from ``TAP_GEMM_MIN_SAMPLES`` samples (B * T) on, a tap GEMM
    and a shifted sum (float32 scratch of [B, C_out * K, T]). Inference only."""
    check_floating(x, "x")
    check_floating(weight, "weight")
    if weight.shape[1] != x.shape[1] or weight.shape[2] % 2 == 0:
        raise ValueError(f"weight must be [C_out, {x.shape[1]}, K] with K odd, got {tuple(weight.shape)}")
    _check_per_channel(weight.shape[0], bias=bias)
    check_same_device(x.device, weight, bias)
    return (_conv_tanh_op if through_op(x, weight, bias) else _conv_tanh)(x, weight, bias)
