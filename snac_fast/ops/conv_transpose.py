"""The decoder's upsampling ConvTranspose1d as a Triton phase GEMM, beside its torch reference.

SNAC's transposed convolutions have kernel 2s, stride s, padding ceil(s/2), output padding s % 2, so
the output is exactly s times longer than the input, and output sample ``j*s + r`` (phase r) is
``W[:, :, m]^T x[:, j]`` plus either ``W[:, :, m+s]^T x[:, j-1]`` (m < s) or ``W[:, :, m-s]^T x[:, j+1]``
(m >= s), with m = r + padding. Packing the taps as one [3, C_out * P, C_in] matrix (P = s rounded up
to a power of two; rows (channel, phase); block g multiplies x shifted by g - 1; inapplicable taps
are zero) makes each program one GEMM over three shifted input tiles. For SNAC's even strides the
phases split in halves that need two shifts each, so the kernel keeps two accumulators and packs
no zero taps (:func:`pack_phase_weight`). The accumulator rows
(channel, phase) x columns j are exactly the output tile [channel, j*s + r]: after a reshape the
store is contiguous in time, in the NCL layout. The bias is fused; the decoder block's input snake
(``alpha_in``) runs as its own kernel first, since each program would recompute it. The input may be channels-last ([B, T, C] memory, as the decoder writes it): the shifted
tiles are then aligned channel rows the K loop prefetches. Short inputs of several batches fold the
batches into the GEMM's columns, so each weight tile serves several batches instead of being
streamed again per batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from snac_fast.ops.common import (
    check_floating,
    check_same_device,
    compute_dtype,
    is_channels_last,
    maybe_snake,
)
from snac_fast.ops.device import (
    HAS_TRITON,
    TRITON_INTERPRET,
    interpreter_configs,
    through_op,
)
from snac_fast.ops.launch import (
    dependent_launch,
    first_filling,
    launch_choice,
    launch_fitting,
    launch_flags,
    wave_programs,
)
from snac_fast.ops.snake import kernel_applies, snake

if HAS_TRITON:
    import triton
    import triton.language as tl

    from snac_fast.ops.common import dot_accumulate, program_tile
    from snac_fast.ops.launch import await_previous_kernel

    @triton.jit
    def _shifted_input(x_rows, col_offset, offs_j, shift: tl.constexpr, time_stride, ch_ok, col_ok, T_in):
        """x[:, j + shift] for a [channels, columns] tile (column offsets ``col_offset`` + j *
        ``time_stride``), zero outside [0, T_in)."""
        src = offs_j + shift
        ok = col_ok & (src >= 0) & (src < T_in)
        return tl.load(x_rows + (col_offset + src * time_stride)[None, :], mask=ch_ok[:, None] & ok[None, :], other=0.0)

    @triton.jit
    def _tap_weights(w_ptr, block: tl.constexpr, rows, n_rows, rows_ok, ch, ch_ok, C_in):
        return tl.load(w_ptr + (block * n_rows + rows)[:, None].to(tl.int64) * C_in + ch[None, :],
                       mask=rows_ok[:, None] & ch_ok[None, :], other=0.0)

    @triton.jit
    def _conv_transpose_kernel(
        x_ptr, w_ptr, bias_ptr, out_ptr,
        C_in, C_out, T_in, n_cols, n_m_blocks, n_j_blocks,
        STRIDE: tl.constexpr, PHASES: tl.constexpr, SPLIT: tl.constexpr, PER_CHANNEL: tl.constexpr,
        FOLD: tl.constexpr, CHANNELS_LAST: tl.constexpr,
        HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr, K_BLOCKS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_previous_kernel(PDL)
        batch, m_block, j_block = program_tile(tl.program_id(0), n_m_blocks, n_j_blocks)
        # packed row = out channel * PER_CHANNEL + phase (P/2 phases per accumulator when SPLIT, else P)
        rows = m_block * (BLOCK_M * PER_CHANNEL) + tl.arange(0, BLOCK_M * PER_CHANNEL)
        n_rows = C_out * PER_CHANNEL
        rows_ok = rows < n_rows
        offs_n = j_block * BLOCK_J + tl.arange(0, BLOCK_J)
        col_ok = offs_n < n_cols
        if FOLD:  # columns run over (batch, j) of all batches: short inputs share a weight tile across batches
            col_batch = offs_n // T_in
            offs_j = offs_n - col_batch * T_in
            col_offset = col_batch.to(tl.int64) * C_in * T_in
        else:  # columns are one batch's j (the grid's batch): contiguous, vector loads
            offs_j = offs_n
            col_offset = batch.to(tl.int64) * C_in * T_in
        acc = tl.zeros((BLOCK_M * PER_CHANNEL, BLOCK_J), dtype=tl.float32)  # phases [0, P/2) when SPLIT, else all
        acc_hi = tl.zeros((BLOCK_M * PER_CHANNEL, BLOCK_J), dtype=tl.float32)  # phases [P/2, P) when SPLIT
        # x in memory: [B, C_in, T_in], or [B, T_in, C_in] (CHANNELS_LAST: the shifted tiles are then
        # whole aligned channel rows, which the K loop can prefetch; time-contiguous ones start at
        # odd 2-byte offsets and are loaded synchronously)
        time_stride = C_in if CHANNELS_LAST else 1
        for kb in range(K_BLOCKS):
            ch = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            ch_ok = ch < C_in
            x_rows = x_ptr + (ch.to(tl.int64)[:, None] if CHANNELS_LAST else ch.to(tl.int64)[:, None] * T_in)
            prev = _shifted_input(x_rows, col_offset, offs_j, -1, time_stride, ch_ok, col_ok, T_in)
            here = _shifted_input(x_rows, col_offset, offs_j, 0, time_stride, ch_ok, col_ok, T_in)
            after = _shifted_input(x_rows, col_offset, offs_j, 1, time_stride, ch_ok, col_ok, T_in)
            w0 = _tap_weights(w_ptr, 0, rows, n_rows, rows_ok, ch, ch_ok, C_in)
            w1 = _tap_weights(w_ptr, 1, rows, n_rows, rows_ok, ch, ch_ok, C_in)
            w2 = _tap_weights(w_ptr, 2, rows, n_rows, rows_ok, ch, ch_ok, C_in)
            if SPLIT:  # low phases take x[j - 1] and x[j], high phases x[j] and x[j + 1]
                w3 = _tap_weights(w_ptr, 3, rows, n_rows, rows_ok, ch, ch_ok, C_in)
                acc = dot_accumulate(acc, w0, prev, IEEE, UPCAST)
                acc = dot_accumulate(acc, w1, here, IEEE, UPCAST)
                acc_hi = dot_accumulate(acc_hi, w2, here, IEEE, UPCAST)
                acc_hi = dot_accumulate(acc_hi, w3, after, IEEE, UPCAST)
            else:  # every phase takes all three, with zero taps where one does not apply
                acc = dot_accumulate(acc, w0, prev, IEEE, UPCAST)
                acc = dot_accumulate(acc, w1, here, IEEE, UPCAST)
                acc = dot_accumulate(acc, w2, after, IEEE, UPCAST)
        # rows (channel, phase) x columns j  ->  [channel, j * PHASES + phase]
        if SPLIT:
            halves = tl.join(tl.reshape(acc, (BLOCK_M, PER_CHANNEL, BLOCK_J)),
                             tl.reshape(acc_hi, (BLOCK_M, PER_CHANNEL, BLOCK_J)))  # [M, P/2, J, half]
            y = tl.reshape(tl.permute(halves, (0, 2, 3, 1)), (BLOCK_M, BLOCK_J * PHASES))
        else:
            y = tl.reshape(tl.permute(tl.reshape(acc, (BLOCK_M, PHASES, BLOCK_J)), (0, 2, 1)), (BLOCK_M, BLOCK_J * PHASES))
        co = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        co_ok = co < C_out
        if HAS_BIAS:
            y += tl.load(bias_ptr + co, mask=co_ok, other=0.0).to(tl.float32)[:, None]
        col = tl.arange(0, BLOCK_J * PHASES)
        T_out = T_in * STRIDE
        if PHASES == STRIDE and not FOLD:  # contiguous columns
            t = batch.to(tl.int64) * C_out * T_out + j_block * BLOCK_J * STRIDE + col
            t_ok = j_block * BLOCK_J * STRIDE + col < T_out
        else:  # per column: its batch (FOLD), and padded phases (stride 3) skipped
            phase = col % PHASES
            n = j_block * BLOCK_J + col // PHASES
            if FOLD:
                b = n // T_in
                t = b.to(tl.int64) * C_out * T_out + (n - b * T_in) * STRIDE + phase
            else:
                t = batch.to(tl.int64) * C_out * T_out + n * STRIDE + phase
            t_ok = (phase < STRIDE) & (n < n_cols)
        out_offs = co.to(tl.int64)[:, None] * T_out + t[None, :]
        tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=co_ok[:, None] & t_ok[None, :])


def upsampling_padding(stride: int) -> tuple[int, int]:
    """(padding, output_padding) of SNAC's upsampling ConvTranspose1d with kernel 2 * stride."""
    return math.ceil(stride / 2), stride % 2


def splits_phases(stride: int) -> bool:
    """True for even power-of-two strides (SNAC's 8, 4, 2): there the low half of the output phases
    takes only x[j - 1] and x[j], the high half only x[j] and x[j + 1], so the kernel packs two taps
    per phase instead of three with a zero among them (a third fewer weight bytes and MACs)."""
    return stride >= 2 and stride & (stride - 1) == 0


def pack_phase_weight(weight: Tensor, stride: int) -> Tensor:
    """ConvTranspose1d weight [C_in, C_out, 2 * stride] -> the kernel's packed taps, same dtype.

    P = next power of two >= stride. Odd strides: [3, C_out * P, C_in]; row ``co * P + r`` of block
    g holds the tap that multiplies x[j + g - 1] for output phase r; padded phases and inapplicable
    taps are zero. Even strides (:func:`splits_phases`): [4, C_out * P/2, C_in]; row ``co * P/2 + r``
    of blocks 0, 1 holds phase r's taps on x[j - 1], x[j]; of blocks 2, 3 phase P/2 + r's on x[j],
    x[j + 1]: no zeros.
    """
    C_in, C_out, K = weight.shape
    if K != 2 * stride:
        raise ValueError(f"needs kernel size 2 * stride = {2 * stride}, got {K}")
    phases = 1 << (stride - 1).bit_length()
    pad, _ = upsampling_padding(stride)
    w = weight.permute(1, 2, 0)  # [C_out, K, C_in]
    if splits_phases(stride):  # pad = stride / 2: phase r has m = r + pad < stride exactly when r < P/2
        half = stride // 2
        packed = weight.new_empty((4, C_out, half, C_in))
        for r in range(half):
            packed[0, :, r], packed[1, :, r] = w[:, r + pad + stride], w[:, r + pad]
            packed[2, :, r], packed[3, :, r] = w[:, r + half + pad], w[:, r + half + pad - stride]
        return packed.reshape(4, C_out * half, C_in).contiguous()
    packed = weight.new_zeros((3, C_out, phases, C_in))
    for r in range(stride):
        m = r + pad
        packed[1, :, r] = w[:, m]
        if m < stride:
            packed[0, :, r] = w[:, m + stride]
        else:
            packed[2, :, r] = w[:, m - stride]
    return packed.reshape(3, C_out * phases, C_in).contiguous()


def conv_transpose_reference(x: Tensor, weight: Tensor, bias: Tensor | None, stride: int,
                             alpha_in: Tensor | None = None) -> Tensor:
    """``conv_transpose1d(snake(x, alpha_in), weight, bias)`` with SNAC's padding, in float32
    (float64 for float64 x); returns x's dtype."""
    compute = compute_dtype(x)
    pad, out_pad = upsampling_padding(stride)
    y = F.conv_transpose1d(maybe_snake(x.to(compute), alpha_in), weight.to(compute),
                           None if bias is None else bias.to(compute), stride=stride, padding=pad,
                           output_padding=out_pad)
    return y.to(x.dtype)


# (accumulator rows = BLOCK_M * phases, BLOCK_J) in order of preference: 128-row tiles as long as the
# grid fills the GPU; narrower rows before narrower columns, since a second column block streams the
# whole weight again (both measured: docs/measurements.md)
_CONVT_TILES = ((128, 128), (128, 32), (128, 16), (64, 32), (32, 32), (32, 16), (16, 16))


def _block_k(C_in: int) -> int:
    """The largest power of two <= 64 that divides C_in (no ragged chunk), at least 16 (tl.dot)."""
    block = 64
    while block > 16 and C_in % block:
        block //= 2
    return block


def _convt_config(C_out: int, phases: int, C_in: int, n_cols: int, batches: int, elem_bytes: int,
                  device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_J, BLOCK_K, num_warps, num_stages) for ``batches`` x [C_out * phases, n_cols]
    outputs (columns: time steps, or all batches' when folded): the biggest tile whose grid still gives
    every SM a program (streaming chunks are latency-bound; docs/measurements.md); 32-deep K steps
    for the biggest tiles; float32 takes at most 32 and 2 stages to fit shared memory."""
    if interpreter_configs():
        block_m = max(1, min(triton.next_power_of_2(C_out), 1024 // phases))
        return block_m, max(16, min(256, triton.next_power_of_2(n_cols))), _block_k(C_in), 4, 3
    cap_m, cap_j = triton.next_power_of_2(C_out), max(16, triton.next_power_of_2(n_cols))
    tiles = [(min(max(1, rows // phases), cap_m), min(j, cap_j)) for rows, j in _CONVT_TILES]
    block_m, block_j = first_filling(tiles, lambda t: batches * triton.cdiv(C_out, t[0]) * triton.cdiv(n_cols, t[1]),
                                     wave_programs(device))
    if elem_bytes == 4:
        return block_m, min(block_j, 64), min(_block_k(C_in), 32), 4, 2
    return block_m, block_j, min(_block_k(C_in), 32 if block_m * phases * block_j >= 8192 else 64), 4, 3


def folds_batches(batch: int, T_in: int) -> bool:
    """Whether the kernel's columns run over all batches' time steps: for inputs shorter than a
    column tile, so that one weight tile serves several batches (per batch, every program would
    stream the whole weight again: streaming chunks of a few batches)."""
    return batch > 1 and T_in < 128


def _conv_transpose_triton(x, packed, bias, stride, config=None):
    B, C_in, T_in = x.shape
    phases = 1 << (stride - 1).bit_length()
    split = splits_phases(stride)
    per_channel = phases // 2 if split else phases
    C_out = packed.shape[1] // per_channel
    out = torch.empty((B, C_out, T_in * stride), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    channels_last = is_channels_last(x)
    if not channels_last:
        x = x.contiguous()
    pdl = None
    if config is None:
        def choose():
            folded = folds_batches(B, T_in)
            batches, cols = (1, B * T_in) if folded else (B, T_in)
            chosen = _convt_config(C_out, phases, C_in, cols, batches, x.element_size(), x.device)
            block_m = max(chosen[0], 16 // per_channel)
            programs = batches * triton.cdiv(C_out, block_m) * triton.cdiv(cols, chosen[1])
            return folded, chosen, dependent_launch(x.device, programs)

        key = ("conv_transpose", x.device, x.dtype, B, C_in, C_out, stride, channels_last, bias is not None)
        fold, config, pdl = launch_choice(key, choose)
    else:
        fold = folds_batches(B, T_in)
    grid_batches, n_cols = (1, B * T_in) if fold else (B, T_in)

    def launch(config):
        block_m, block_j, block_k, warps, stages = config
        block_m = max(block_m, 16 // per_channel)  # tl.dot needs 16 rows
        n_m, n_j = triton.cdiv(C_out, block_m), triton.cdiv(n_cols, block_j)
        _conv_transpose_kernel[(grid_batches * n_m * n_j,)](
            x, packed, packed if bias is None else bias, out,
            C_in, C_out, T_in, n_cols, n_m, n_j,
            STRIDE=stride, PHASES=phases, SPLIT=split, PER_CHANNEL=per_channel, FOLD=fold,
            CHANNELS_LAST=channels_last, HAS_BIAS=bias is not None,
            IEEE=x.dtype == torch.float32, UPCAST=TRITON_INTERPRET and x.dtype == torch.bfloat16,
            BLOCK_M=block_m, BLOCK_J=block_j, BLOCK_K=block_k, K_BLOCKS=triton.cdiv(C_in, block_k),
            num_warps=warps, num_stages=stages, **launch_flags(x.device, grid_batches * n_m * n_j, pdl),
        )
    launch_fitting(("conv_transpose", x.device, x.dtype), config, launch)
    return out


def _conv_transpose(x: Tensor, weight: Tensor, packed: Tensor, bias: Tensor | None, stride: int,
                    alpha_in: Tensor | None) -> Tensor:
    if kernel_applies(x):
        if alpha_in is not None:
            # once, before the GEMM: inside it each output-channel block recomputed it on every K step
            # (over 4x slower; docs/measurements.md)
            x = snake(x, alpha_in)
        return _conv_transpose_triton(x, packed, bias, stride)
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return conv_transpose_phases(maybe_snake(x, alpha_in), weight, bias, stride)
    return conv_transpose_reference(x, weight, bias, stride, alpha_in).contiguous()


def phase_conv_weight(weight: Tensor, stride: int) -> Tensor:
    """[C_in, C_out, 2s] -> [C_out * s, C_in, 2]: output phase r of channel o takes input t - 1
    through tap r + s and input t through tap r. Kept on the tensor for its version (packing block
    1's 33.5 MB weight took longer than the conv)."""
    kept = getattr(weight, "_snac_fast_phases", None)
    if kept is not None and kept[0] == (weight._version, stride):
        return kept[1]
    C_in, C_out, _ = weight.shape
    taps = weight.detach().permute(1, 2, 0)  # [C_out, 2s, C_in]
    phases = torch.stack([taps[:, stride:], taps[:, :stride]], dim=-1).reshape(C_out * stride, C_in, 2).contiguous()
    weight._snac_fast_phases = ((weight._version, stride), phases)
    return phases


def conv_transpose_phases(x: Tensor, weight: Tensor, bias: Tensor | None, stride: int) -> Tensor:
    """SNAC's upsampling transposed conv (kernel 2s, padding ceil(s/2), output padding s % 2) as one
    ordinary conv over each pair of neighbouring inputs, its C_out * s outputs the s phases: on a CPU
    oneDNN runs it where the transposed conv took PyTorch's slow path (block 1 of the 24 kHz decoder:
    6.7 -> 3.8 ms for 16 frames; docs/streaming.md). The same sums as
    :func:`conv_transpose_reference` in another order."""
    B, _, T = x.shape
    C_out = weight.shape[1]
    z = F.conv1d(F.pad(x, (1, 1)), phase_conv_weight(weight, stride))  # [B, C_out * s, T + 1]
    full = z.view(B, C_out, stride, T + 1).transpose(2, 3).reshape(B, C_out, (T + 1) * stride)
    pad, _ = upsampling_padding(stride)
    y = full[:, :, pad:pad + T * stride]
    return (y + bias[None, :, None] if bias is not None else y).contiguous()


_conv_transpose_op = torch.library.custom_op("snac_fast::conv_transpose", _conv_transpose, mutates_args=())


@_conv_transpose_op.register_fake
def _(x, weight, packed, bias, stride, alpha_in):
    return x.new_empty((x.shape[0], weight.shape[1], x.shape[2] * stride))


def conv_transpose(x: Tensor, weight: Tensor, bias: Tensor | None, stride: int, *,
                   alpha_in: Tensor | None = None, packed: Tensor | None = None) -> Tensor:
    """SNAC's upsampling ``conv_transpose1d(snake(x, alpha_in), weight, bias, stride, padding=ceil(s/2),
    output_padding=s % 2)``; the snake is optional.

    x: [B, C_in, T], contiguous or (fastest) channels-last, i.e. [B, T, C_in] memory; weight:
    [C_in, C_out, 2 * stride]; bias, alpha_in: [C_out], [C_in].
    packed: :func:`pack_phase_weight` of weight in x's dtype (pass it to avoid repacking per call).
    Returns [B, C_out, stride * T] contiguous in x's dtype. Inference only.
    """
    check_floating(x, "x")
    check_floating(weight, "weight")
    C_in = x.shape[1]
    if weight.shape[0] != C_in or weight.shape[2] != 2 * stride:
        raise ValueError(f"weight must be [{C_in}, C_out, {2 * stride}], got {tuple(weight.shape)}")
    if bias is not None and bias.numel() != weight.shape[1] or alpha_in is not None and alpha_in.numel() != C_in:
        raise ValueError(f"bias needs {weight.shape[1]} values and alpha_in {C_in}")
    if packed is None:
        packed = pack_phase_weight(weight.to(x.dtype), stride)
    check_same_device(x.device, weight, packed, bias, alpha_in)
    run = _conv_transpose_op if through_op(x, weight, bias, alpha_in) else _conv_transpose
    return run(x, weight, packed, bias, int(stride), alpha_in)
