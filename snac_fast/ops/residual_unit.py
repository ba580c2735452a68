"""A whole residual unit in one Gluon kernel on Hopper, beside its torch reference.

The unit ``y = x + W @ snake(dwconv7(snake(x)) + b_dw, alpha2) + b_pw`` runs elsewhere as two
Triton kernels (``ops/depthwise``: the depthwise conv and its snake; ``ops/pointwise``: the 1x1
GEMM, residual add and the next unit's input snake), and the depthwise output h makes a round trip
through memory between them: 6 passes over the unit's activation (read s; write h; read h and x;
write y and snake(y)). Here one program keeps a tile of h on chip: it computes the depthwise conv of
its [C, BT] tile from the input snake s (aligned 16-byte chunks around runs of 8 outputs, taps
chosen among registers, as ``ops/depthwise`` does), stores h in shared memory in the wgmma layout,
multiplies on the tensor cores (``out^T = h^T @ W^T``, M = BT steps, N = K = C), and writes the
epilogue: 4 passes. Written in Gluon (``triton.experimental.gluon``) because the one-kernel unit in
plain Triton measured slower than the two kernels (docs/kernels.md): Gluon places h in the wgmma
operand layout explicitly and issues the MMA itself.

The kernel reads s at other tiles' positions (the conv's halo), so ``snake_out`` must not alias s;
``out`` may alias x (each program reads x only where it writes y).

The kernel takes up to 128 channels (padded to a power of two in registers, masked in memory); the
decoder and encoder call it (:func:`unit_applies`) for fp16 on sm_90 where it measured faster
(:func:`unit_is_faster`: up to 64 channels at every dilation, 128 at dilations 1 and 3);
everything else keeps the two kernels. ``SNAC_FAST_GLUON=0`` turns it off.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from snac_fast.ops.depthwise import depthwise_conv_snake_reference
from snac_fast.ops.device import HAS_TRITON, gpu_limits
from snac_fast.ops.pointwise import pointwise_conv_reference
from snac_fast.ops.snake import snake_reference

MAX_CHANNELS = 128  # h, W and the accumulator of a 64-step tile fit one SM's registers up to here
# Where the decoder takes it (H100, every snake from the SFU in both paths; docs/kernels.md):
# at 48-64 channels 1.06-1.44x the two kernels at every dilation; at 128 channels 1.07-1.15x at
# dilations 1 and 3 (pair out, as a block's first two units write), 0.88-0.96x at dilation 9 (9 chunk
# loads a run). 96 channels fill three quarters of the 128-channel tile: 1.06-1.08x alone at dilations 1
# and 3 but no gain in whole 32/44 kHz decodes, so they keep the two kernels.
APPLIES_UP_TO = 64
APPLIES_AT_LOW_DILATION = 128
KERNEL_SIZE = 7

HAS_GLUON = False
if HAS_TRITON:
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import (
            fence_async_shared,
            warpgroup_mma,
            warpgroup_mma_wait,
        )

        HAS_GLUON = True
    except ImportError:  # pragma: no cover - Triton before Gluon (3.5)
        pass

if HAS_GLUON:
    # the Triton helpers of ops/depthwise and ops/common run inside Gluon kernels as they are
    from snac_fast.ops.common import snake_broadcast
    from snac_fast.ops.depthwise import lanes_of, window_of

    @gluon.jit
    def _weights_to_shared(w_ptr, C, C_P: gl.constexpr, layout: gl.constexpr):
        """W [C, C] (row-major fp16) zero-padded into a fresh [C_P, C_P] shared-memory tile."""
        num_warps: gl.constexpr = gl.num_warps()
        LW: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        wo = gl.arange(0, C_P, layout=gl.SliceLayout(1, LW))
        wi = gl.arange(0, C_P, layout=gl.SliceLayout(0, LW))
        w = gl.load(w_ptr + wo[:, None] * C + wi[None, :], mask=(wo < C)[:, None] & (wi < C)[None, :], other=0.0)
        w_smem = gl.allocate_shared_memory(gl.float16, [C_P, C_P], layout)
        w_smem.store(w.to(gl.float16))
        return w_smem

    @gluon.jit
    def _pointwise_mma(h_smem, w_smem, C_P: gl.constexpr, BT: gl.constexpr, WARPS_M: gl.constexpr):
        """out^T [BT, C_P] fp32 = h^T @ W^T from shared memory (h [C_P, BT], W [C_P, C_P]) as one
        warpgroup MMA, M = BT steps on WARPS_M warps, N split over the others. Stores to either
        tile must be fenced (``fence_async_shared``) before."""
        num_warps: gl.constexpr = gl.num_warps()
        WARPS_N: gl.constexpr = num_warps // WARPS_M
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N],
                                                        instr_shape=[16, C_P // WARPS_N, 16])
        acc = gl.zeros([BT, C_P], gl.float32, mma_l)
        acc = warpgroup_mma(h_smem.permute((1, 0)), w_smem.permute((1, 0)), acc, is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    @gluon.jit
    def _unit_tail(h, x_ptr, w_ptr, pw_b_ptr, alpha_out_ptr, out_ptr, snake_out_ptr, b, t0, T, C,
                   out_stride_b, out_stride_c, out_stride_t, C_P: gl.constexpr, BT: gl.constexpr,
                   WARPS_M: gl.constexpr, PAIR: gl.constexpr, SNAKE_OUT: gl.constexpr,
                   CHANNELS_LAST: gl.constexpr):
        """The unit after its depthwise conv: h [C_P, BT] fp16 (any layout) -> the 1x1 conv on the
        tensor cores, bias, residual, snake and the stores (see the kernel)."""
        num_warps: gl.constexpr = gl.num_warps()
        # 1x1 conv on the tensor cores: out^T [BT, C] = h^T [BT, C] @ W^T [C, C], both from shared memory
        smem_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        h_smem = gl.allocate_shared_memory(gl.float16, [C_P, BT], smem_l)
        h_smem.store(h)
        w_smem = _weights_to_shared(w_ptr, C, C_P, smem_l)
        fence_async_shared()
        acc = _pointwise_mma(h_smem, w_smem, C_P, BT, WARPS_M)

        # epilogue: bias, residual and snake in 16-byte runs along T (x is channels-first); a
        # channels-last output is converted to runs along C for its store
        EL: gl.constexpr = gl.BlockedLayout([8, 1], [BT // 8, 256 // BT], [1, num_warps], [0, 1])
        y = gl.convert_layout(acc, EL)
        t = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, EL))
        o = gl.arange(0, C_P, layout=gl.SliceLayout(0, EL))
        o_ok = o < C
        m2 = (t < T)[:, None] & o_ok[None, :]
        y += gl.load(pw_b_ptr + o, mask=o_ok, other=0.0).to(gl.float32)[None, :]
        xo = (b * C + o).to(gl.int64) * T
        y += gl.load(x_ptr + xo[None, :] + t[:, None], mask=m2, other=0.0).to(gl.float32)
        if PAIR or SNAKE_OUT:
            alpha_out = gl.load(alpha_out_ptr + o, mask=o_ok, other=1.0).to(gl.float32)[None, :]
            ys = snake_broadcast(y, alpha_out, gl.float16)
        if SNAKE_OUT:
            result = ys.to(gl.float16)
        else:
            result = y.to(gl.float16)
        if CHANNELS_LAST:
            CL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
            result = gl.convert_layout(result, CL)
            tc = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, CL))
            oc = gl.arange(0, C_P, layout=gl.SliceLayout(0, CL))
            mc = (tc < T)[:, None] & (oc < C)[None, :]
        else:
            tc, oc, mc = t, o, m2
        dst = (out_ptr + b.to(gl.int64) * out_stride_b + oc[None, :].to(gl.int64) * out_stride_c
               + tc[:, None].to(gl.int64) * out_stride_t)
        gl.store(dst, result, mask=mc)
        if PAIR:
            gl.store(snake_out_ptr + xo[None, :] + t[:, None], ys.to(gl.float16), mask=m2)

    @gluon.jit
    def _residual_unit_kernel(
        x_ptr, s_ptr, w_ptr, dw_w_ptr, dw_b_ptr, alpha2_ptr, pw_b_ptr, alpha_out_ptr, out_ptr, snake_out_ptr,
        T, C, out_stride_b, out_stride_c, out_stride_t,
        C_P: gl.constexpr, DILATION: gl.constexpr, BT: gl.constexpr, WARPS_M: gl.constexpr,
        PAIR: gl.constexpr, SNAKE_OUT: gl.constexpr, CHANNELS_LAST: gl.constexpr, num_warps: gl.constexpr,
    ):
        """One [C, BT] tile of batch row program_id(1). x, s: [B, C, T] contiguous; w: [C, C];
        dw_w: [C, 7]; per-channel vectors [C]. Writes out (strided) = y, or snake(y, alpha_out) if
        SNAKE_OUT; PAIR also writes snake_out = snake(y, alpha_out) ([B, C, T] contiguous)."""
        b = gl.program_id(1)
        t0 = gl.program_id(0) * BT
        NR: gl.constexpr = BT // 8
        CH: gl.constexpr = (3 * DILATION + 7) // 8  # halo chunks on each side of a run

        # depthwise conv + bias + snake: [C_P, NR, 8], each thread runs of 8 outputs
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [32 // NR, NR, 1], [num_warps, 1, 1], [2, 1, 0])
        L2: gl.constexpr = gl.SliceLayout(0, L3)
        c = gl.arange(0, C_P, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        r = gl.arange(0, NR, layout=gl.SliceLayout(1, L2))
        e = gl.arange(0, 8, layout=gl.SliceLayout(0, L2))
        c_ok = c < C
        row = (b * C + c).to(gl.int64) * T
        pos = t0 + r[:, None] * 8 + e[None, :]
        base = s_ptr + row[:, None, None]
        lanes = ()
        for q in gl.static_range(-CH, 1 + CH):  # whole chunks are in [0, T) or out (zero padding)
            src = pos + q * 8
            m = c_ok[:, None, None] & ((src >= 0) & (src < T))[None, :, :]
            lanes = lanes + lanes_of(gl.load(base + src[None, :, :], mask=m, other=0.0).to(gl.float32))
        acc3 = gl.zeros([C_P, NR, 8], gl.float32, L3)
        for k in gl.static_range(7):
            wk = gl.load(dw_w_ptr + c * 7 + k, mask=c_ok, other=0.0).to(gl.float32)
            tap = gl.convert_layout(window_of(lanes, (k - 3) * DILATION + 8 * CH), L3, assert_trivial=True)
            acc3 += wk[:, None, None] * tap
        acc3 += gl.load(dw_b_ptr + c, mask=c_ok, other=0.0).to(gl.float32)[:, None, None]
        alpha2 = gl.load(alpha2_ptr + c, mask=c_ok, other=1.0).to(gl.float32)[:, None, None]
        h = gl.reshape(snake_broadcast(acc3, alpha2, gl.float16).to(gl.float16), (C_P, BT))

        _unit_tail(h, x_ptr, w_ptr, pw_b_ptr, alpha_out_ptr, out_ptr, snake_out_ptr, b, t0, T, C,
                   out_stride_b, out_stride_c, out_stride_t, C_P, BT, WARPS_M, PAIR, SNAKE_OUT, CHANNELS_LAST)


def residual_unit_reference(x: Tensor, s: Tensor, dw_weight: Tensor, dw_bias: Tensor | None, dilation: int,
                            alpha2: Tensor, pw_weight: Tensor, pw_bias: Tensor | None,
                            alpha_out: Tensor | None = None) -> Tensor:
    """y = x + pw(snake(dw(s) + b_dw, alpha2)) + b_pw in float32 (float64 for float64 input), h
    rounded to x's dtype between the convs as the kernels do; snake(y, alpha_out) if given.
    x, s: [B, C, T]; dw_weight [C, 1, 7]; pw_weight [C, C, 1]. Returns float32/float64."""
    h = depthwise_conv_snake_reference(s, dw_weight, dw_bias, dilation, alpha2)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = pointwise_conv_reference(h.to(compute), pw_weight.to(compute), pw_bias, residual=x.to(compute))
    return y if alpha_out is None else snake_reference(y, alpha_out)


def unit_tiling(channels: int) -> tuple[int, int, int, int]:
    """(C_P, BT, num_warps, WARPS_M) for a unit of ``channels``: channels padded to a power of two,
    64-step tiles on 8 warps (wgmma's M of 64 on 4 of them, N split over 2), so each thread holds
    C_P * BT / 8 / 256 <= 4 runs of 8 outputs (at 128 channels, 128-step tiles spilled at dilation 9:
    docs/kernels.md)."""
    if not 1 <= channels <= MAX_CHANNELS:
        raise ValueError(f"the one-kernel unit takes 1..{MAX_CHANNELS} channels, got {channels}")
    c_p = max(64, 1 << (channels - 1).bit_length())  # 64: the smallest 128-byte-swizzled W tile
    return c_p, 64, 8, 4


def unit_is_faster(channels: int, dilation: int) -> bool:
    """Whether the one kernel measured faster than the two for a unit of this width and dilation
    (the constants above)."""
    return channels <= APPLIES_UP_TO or (channels == APPLIES_AT_LOW_DILATION and dilation <= 3)


def unit_applies(x: Tensor, channels: int, dilation: int) -> bool:
    """Whether :func:`residual_unit` runs the Gluon kernel for x ([B, C, T]); else callers keep
    the two kernels. Where :func:`unit_is_faster`, on Hopper only (wgmma: compute capability 9.x), as
    the launch rules see the device (``SNAC_FAST_GPU_LIMITS`` and
    :func:`~snac_fast.ops.device.emulate_gpu` included)."""
    if not (HAS_GLUON and x.is_cuda and x.dtype == torch.float16 and unit_is_faster(channels, dilation)
            and os.environ.get("SNAC_FAST_GLUON", "1") != "0"):
        return False
    limits = gpu_limits(x.device)
    return limits is not None and limits.capability[0] == 9


def residual_unit(x: Tensor, s: Tensor, dw_weight: Tensor, dw_bias: Tensor, dilation: int, alpha2: Tensor,
                  pw_weight: Tensor, pw_bias: Tensor, *, pair_alpha: Tensor | None = None,
                  alpha_out: Tensor | None = None, out: Tensor | None = None,
                  channels_last: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The unit in one kernel (see the module docstring); x and s: [B, C, T] fp16 contiguous, s = the
    unit's input snake of x. ``pair_alpha``: return (y, snake(y, pair_alpha)) (the next unit's input
    pair); ``alpha_out``: return snake(y, alpha_out) alone; neither: y. ``out``: y's destination
    ([B, C, T] contiguous; may be x), or with ``channels_last`` a [B, T, C]-contiguous one seen as
    [B, C, T]. Call only where :func:`unit_applies`."""
    B, C, T = x.shape
    if s.shape != x.shape or not (x.is_contiguous() and s.is_contiguous()):
        raise ValueError(f"x and s must be contiguous [B, C, T] of one shape, got {tuple(x.shape)}, {tuple(s.shape)}")
    if dw_weight.shape != (C, 1, KERNEL_SIZE) or pw_weight.shape[:2] != (C, C):
        raise ValueError(f"unit weights must be [{C}, 1, 7] and [{C}, {C}, 1], got "
                         f"{tuple(dw_weight.shape)}, {tuple(pw_weight.shape)}")
    if dw_bias is None or pw_bias is None:
        raise ValueError("the one-kernel unit needs both convs' biases")
    if pair_alpha is not None and alpha_out is not None:
        raise ValueError("pair_alpha and alpha_out are exclusive")
    if out is None:
        out = (torch.empty((B, T, C), dtype=x.dtype, device=x.device).transpose(1, 2) if channels_last
               else torch.empty_like(x))
    snake_out = torch.empty_like(x) if pair_alpha is not None else out  # never s: other tiles read its halo
    if x.numel():
        c_p, bt, warps, warps_m = unit_tiling(C)
        per_channel = lambda v: v.reshape(-1)  # noqa: E731
        alpha = pair_alpha if pair_alpha is not None else alpha_out
        _residual_unit_kernel[(-(-T // bt), B)](
            x, s, pw_weight.reshape(C, C), dw_weight.reshape(C, KERNEL_SIZE), per_channel(dw_bias),
            per_channel(alpha2), per_channel(pw_bias), per_channel(alpha if alpha is not None else alpha2),
            out, snake_out, T, C, out.stride(0), out.stride(1), out.stride(2),
            C_P=c_p, DILATION=dilation, BT=bt, WARPS_M=warps_m, PAIR=pair_alpha is not None,
            SNAKE_OUT=alpha_out is not None, CHANNELS_LAST=channels_last, num_warps=warps)
    return (out, snake_out) if pair_alpha is not None else out
