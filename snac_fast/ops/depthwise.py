"""The residual unit's depthwise conv and Snake as one Triton kernel, beside its torch reference.


``depthwise_conv_snake``: the residual unit's middle, ``snake(depthwise_conv(x) + bias, alpha)`` with a
dilated K-tap per-channel filter and zero padding (K-1)*dilation/2, in one pass (taps and alpha in
registers, fp32 accumulation; x is read from memory about once). Where T % 8 == 0 each thread loads
the aligned 16-byte chunks around its run of outputs once and shifts taps among its registers;
other lengths load each tap as a shifted tile (unaligned 2-byte loads, mostly L1 hits).
The unit's first snake is not computed here: inside this kernel it would be recomputed for each of
the 7 taps, which measured slower at every decoder shape, streaming chunks included
(docs/measurements.md). The layer before the unit writes it instead (``pointwise_conv_pair``).
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
    maybe_snake,
)
from snac_fast.ops.device import HAS_TRITON, interpreter_configs, through_op
from snac_fast.ops.launch import (
    dependent_launch,
    launch_choice,
    launch_flags,
    wave_programs,
)
from snac_fast.ops.snake import kernel_applies

if HAS_TRITON:
    import triton
    import triton.language as tl

    from snac_fast.ops.common import snake_broadcast
    from snac_fast.ops.launch import await_previous_kernel

    @triton.jit
    def lanes_of(v):
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
    def window_of(lanes, START: tl.constexpr):
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
            acc = snake_broadcast(acc, tl.load(alpha_ptr + rows % C, mask=row_ok, other=1.0).to(tl.float32),
                                   out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows.to(tl.int64) * T + cols, acc.to(out_ptr.dtype.element_ty), mask=row_ok & (cols < T))

    @triton.jit
    def _depthwise_runs(x_ptr, w_ptr, bias_ptr, alpha_ptr, out_ptr, rows, runs, n_rows, C, T,
                        K: tl.constexpr, DILATION: tl.constexpr, HAS_BIAS: tl.constexpr, SNAKE: tl.constexpr,
                        RUN: tl.constexpr):
        """A tile of rows [R] x runs [N] for T % 8 == 0: each thread computes runs of RUN aligned chunks
        of 8 outputs (``runs``: their first steps). A run's neighbourhood is loaded once, as whole
        aligned 16-byte chunks, and each tap's shift becomes a choice among registers made at compile
        time: per 8 outputs, (RUN + 2 * ceil(halo / 8)) / RUN vector loads (3 / 5 / 9 at dilation
        1 / 3 / 9 for RUN = 1), where a shifted tile load costs 8 unaligned 2-byte loads per tap.
        Every tile masks its chunks, interior ones too: a second, unmasked copy of this unrolled code
        for interior tiles was a fifth of the kernel's compile time (a cold start compiles it ~50
        times) and won at most 1% (docs/cold_start.md)."""
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
            # zero padding outside [0, T): whole chunks are in or out
            chunk = tl.load(ptrs, mask=row_ok[:, None, None] & ((src >= 0) & (src < T))[None, :, :], other=0.0)
            lanes = lanes + lanes_of(chunk.to(tl.float32))
        taps = ()
        for k in tl.static_range(K):
            taps = taps + (tl.load(w_ptr + chan * K + k, mask=row_ok, other=0.0).to(tl.float32)[:, None, None],)
        for j in tl.static_range(RUN):
            acc = tl.zeros((rows.shape[0], runs.shape[0], 8), dtype=tl.float32)
            for k in tl.static_range(K):
                acc += taps[k] * window_of(lanes, (k - (K - 1) // 2) * DILATION + 8 * (CHUNKS + j))
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

    # T's alignment is known from RUN (T % 8 == 0), not Triton's divisible-by-16 specialization: lengths
    # that are multiples of 8 but not of 16 compiled a second variant of each launch (cold starts)
    @triton.jit(do_not_specialize_on_alignment=["T"])
    def _depthwise_conv_snake_kernel(
        x_ptr, w_ptr, bias_ptr, alpha_ptr, out_ptr,
        n_rows, C, T, n_t_blocks,
        K: tl.constexpr, DILATION: tl.constexpr, HAS_BIAS: tl.constexpr,
        SNAKE: tl.constexpr, RUN: tl.constexpr, ROWS: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr,
    ):
        """RUN = 0: every tap a shifted tile load (any T); RUN = 1 or 2: runs of 8 or 16 outputs per
        thread from aligned chunks (T % 8 == 0, BLOCK_T a multiple of 8 * RUN)."""
        await_previous_kernel(PDL)
        if RUN > 0:
            T = T // 8 * 8  # the same value, known to the compiler as a multiple of 8 (multiple_of on an argument is not)
        pid = tl.program_id(0)
        row_block = pid // n_t_blocks
        t_block = pid - row_block * n_t_blocks
        rows = row_block * ROWS + tl.arange(0, ROWS)
        if RUN > 0:
            runs = t_block * BLOCK_T + tl.arange(0, BLOCK_T // (8 * RUN)) * (8 * RUN)
            _depthwise_runs(x_ptr, w_ptr, bias_ptr, alpha_ptr, out_ptr, rows, runs, n_rows, C, T,
                            K, DILATION, HAS_BIAS, SNAKE, RUN)
        else:
            halo = (K - 1) // 2 * DILATION
            interior = (t_block * BLOCK_T >= halo) & ((t_block + 1) * BLOCK_T + halo <= T) & ((row_block + 1) * ROWS <= n_rows)
            row_ok = rows < n_rows
            chan = rows % C
            row_base = rows.to(tl.int64) * T
            cols = t_block * BLOCK_T + tl.arange(0, BLOCK_T)
            if interior:
                acc = _depthwise_taps(x_ptr, w_ptr, row_base, chan, row_ok, cols, T, K, DILATION, False, ROWS, BLOCK_T)
            else:
                acc = _depthwise_taps(x_ptr, w_ptr, row_base, chan, row_ok, cols, T, K, DILATION, True, ROWS, BLOCK_T)
            _bias_snake_store(acc, bias_ptr, alpha_ptr, out_ptr, rows[:, None], cols[None, :], n_rows, C, T, HAS_BIAS, SNAKE)


# --- reference -------------------------------------------------------------------------------

def depthwise_conv_snake_reference(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int,
                                   alpha: Tensor | None) -> Tensor:
    """``snake(conv1d(x, weight, bias, padding=(K-1)*dilation//2, dilation, groups=C), alpha)`` in
    float32 (float64 for float64 input), returned in x's dtype. weight: [C, 1, K]."""
    compute = compute_dtype(x)
    K = weight.shape[-1]
    y = F.conv1d(x.to(compute), weight.to(compute), None if bias is None else bias.to(compute),
                 padding=(K - 1) * dilation // 2, dilation=dilation, groups=x.shape[1])
    return maybe_snake(y, alpha).to(x.dtype)


# --- launcher --------------------------------------------------------------------------------

def _dw_config(n_rows: int, T: int, halo: int, device: torch.device) -> tuple[int, int, int, int]:
    """(ROWS, BLOCK_T, num_warps, RUN) for the depthwise kernel over [n_rows, T] with a tap reach of
    ``halo`` steps each side, as measured fastest at the 24 kHz decoder's shapes (a sweep of rows,
    length, warps and run length; docs/measurements.md).
    T % 8 == 0 (every decoder layer after the first) takes runs of aligned chunks: on a small grid,
    tiles of up to 2048 outputs, 8 per thread, at least a wave of programs; rows up to 4096 steps
    as one tile each, 16 outputs per thread, in runs of 16 where the halo spans more than two
    chunks (dilation 9), unless a row past 512 steps would fill under 60% of its tile: then 4 rows
    of 256-step tiles, 32 outputs per thread (a sweep at stream-step shapes); longer rows in
    2048-step tiles of 32 outputs per thread. Other T: per-tap loads (RUN = 0), 512-element tiles
    of one warp, or of four while the grid is small."""
    if interpreter_configs():  # few, big programs of per-tap loads: the interpreter pays per program and per
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
    elif 512 < T <= 4096 and 5 * T < 3 * triton.next_power_of_2(T):
        # a row as one tile would leave over 40% of its lanes idle (stream steps: 1120 and 2144 steps):
        # 4 rows of 256-step tiles, 32 outputs per thread on one warp (faster at 64-stream steps;
        # docs/measurements.md)
        return 4, 256, 1, 2 if halo > 16 else 1
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

    def choose():
        chosen = _dw_config(B * C, T, (K - 1) // 2 * dilation, x.device)
        return chosen, dependent_launch(x.device, triton.cdiv(B * C, chosen[0]) * triton.cdiv(T, chosen[1]))

    key = ("depthwise", x.device, B * C, K, dilation, bias is not None, alpha is not None)
    runs_fit = lambda choice: choice[0][3] == 0 or T % 8 == 0  # noqa: E731 - aligned runs need T % 8 == 0
    (rows, block_t, warps, run), pdl = (config, None) if config else launch_choice(key, choose, runs_fit)
    n_t_blocks = triton.cdiv(T, block_t)
    grid = (triton.cdiv(B * C, rows) * n_t_blocks,)
    w = weight.reshape(C, K)
    flat = lambda t: w if t is None else t.reshape(-1)  # noqa: E731 - an unused pointer slot
    _depthwise_conv_snake_kernel[grid](
        x, w, flat(bias), flat(alpha), out,
        B * C, C, T, n_t_blocks,
        K=K, DILATION=dilation, HAS_BIAS=bias is not None, SNAKE=alpha is not None,
        RUN=run, ROWS=rows, BLOCK_T=block_t, num_warps=warps, **launch_flags(x.device, grid[0], pdl),
    )
    return out


# --- torch.library op (what torch.compile sees; plain inference calls its body) and the public function 

def _depthwise_conv_snake(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int,
                          alpha: Tensor | None) -> Tensor:
    if kernel_applies(x):
        return _depthwise_conv_snake_triton(x, weight, bias, dilation, alpha)
    return depthwise_conv_snake_reference(x, weight, bias, dilation, alpha).contiguous()


_depthwise_conv_snake_op = torch.library.custom_op("snac_fast::depthwise_conv_snake", _depthwise_conv_snake,
                                                   mutates_args=())


@_depthwise_conv_snake_op.register_fake
def _(x, weight, bias, dilation, alpha):
    return x.new_empty(x.shape)


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
    check_per_channel(C, bias=bias, alpha=alpha)
    if dilation < 1:
        raise ValueError(f"dilation must be >= 1, got {dilation}")
    check_same_device(x.device, weight, bias, alpha)
    run = _depthwise_conv_snake_op if through_op(x, weight, bias, alpha) else _depthwise_conv_snake
    return run(x, weight, bias, int(dilation), alpha)
