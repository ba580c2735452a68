"""The decoder's output layer (conv, then tanh) as Triton kernels, beside its torch reference.


``conv_tanh``: the decoder's output layer, a "same"-padded conv1d to few channels, then tanh: one
kernel, or for long inputs two (``takes_tap_gemm``): a GEMM of every tap over aligned tiles into
float32 sums per tap, then their shifted sum and tanh.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from snac_fast.ops.common import (
    check_floating,
    check_per_channel,
    check_same_device,
    compute_dtype,
)
from snac_fast.ops.device import (
    HAS_TRITON,
    TRITON_INTERPRET,
    interpreter_configs,
    through_op,
)
from snac_fast.ops.launch import first_filling, launch_flags, wave_programs
from snac_fast.ops.snake import kernel_applies

if HAS_TRITON:
    import triton
    import triton.language as tl

    from snac_fast.ops.common import dot_accumulate, program_tile
    from snac_fast.ops.launch import await_previous_kernel

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
        batch, co, t_block = program_tile(tl.program_id(0), C_out, n_t_blocks)
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
        batch, _, t_block = program_tile(tl.program_id(0), 1, n_t_blocks)
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
            acc = dot_accumulate(acc, a, b, IEEE, UPCAST)
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


# --- reference -------------------------------------------------------------------------------

def conv_tanh_reference(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``tanh(conv1d(x, weight, bias, padding=(K-1)//2))`` in float32 (float64 for float64 input)."""
    compute = compute_dtype(x)
    y = F.conv1d(x.to(compute), weight.to(compute), None if bias is None else bias.to(compute),
                 padding=(weight.shape[-1] - 1) // 2)
    return torch.tanh(y).to(x.dtype)


# --- launchers -------------------------------------------------------------------------------

# (BLOCK_C, BLOCK_T): 4,096-element tiles, shorter in time while the grid is small
_TANH_TILES = ((16, 256), (32, 128), (64, 64), (64, 32))


def _conv_tanh_config(rows: int, T: int, device: torch.device) -> tuple[int, int, int]:
    if interpreter_configs():
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
    block_t = min(max(16, triton.next_power_of_2(T)), block_t or (4096 if interpreter_configs() else 128))
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


# --- torch.library op (what torch.compile sees; plain inference calls its body) and the public function 

def _conv_tanh(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if kernel_applies(x):
        if takes_tap_gemm(x, weight):
            return _conv_tanh_by_taps(x, weight, bias)
        return _conv_tanh_triton(x, weight, bias)
    return conv_tanh_reference(x, weight, bias).contiguous()


_conv_tanh_op = torch.library.custom_op("snac_fast::conv_tanh", _conv_tanh, mutates_args=())


@_conv_tanh_op.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0], x.shape[2]))


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
    check_per_channel(weight.shape[0], bias=bias)
    check_same_device(x.device, weight, bias)
    return (_conv_tanh_op if through_op(x, weight, bias) else _conv_tanh)(x, weight, bias)
