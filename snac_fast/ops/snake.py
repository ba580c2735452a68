"""Snake activation ``y = x + sin^2(alpha * x) / (alpha + 1e-9)``: Triton kernels and torch reference.

Layout: x is [B, C, T] (any strides), alpha has one value per channel. The kernels read x in its own
dtype, compute in float32 registers and write a contiguous output in x's dtype.

Fast sine: sin^2 and sin(2 *) have period pi, so the argument is reduced to |r| <= pi/2 by a
three-part Cody-Waite subtraction of the nearest multiple of pi (each part has 12 significant bits,
so k * part is exact for |alpha * x| < 12,867) and sin(r) is an odd degree-9 polynomial fitted to
minimise the max error on [-pi/2, pi/2]. Max error of sin^2 against float64 on the same float32
argument is 3.5e-7 for |alpha * x| <= 1000 (tests/ops/test_snake.py checks < 2e-6); that is float32
rounding level, so the fast path is as faithful as ``tl.sin`` while costing a handful of FMAs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from snac_fast.ops.device import (
    HAS_TRITON,
    TRITON_INTERPRET,
    interpreter_configs,
    runs_triton,
    through_op,
)
from snac_fast.ops.launch import launch_flags

EPS = 1e-9  # upstream's guard in 1 / (alpha + 1e-9)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from snac_fast.ops.launch import await_previous_kernel

    _INV_PI = tl.constexpr(0.3183098861837907)
    _PI_A = tl.constexpr(3.140625)  # pi split in 12-bit pieces: k * piece is exact in float32
    _PI_B = tl.constexpr(0.0009675025939941406)
    _PI_C = tl.constexpr(1.5099580252808664e-07)
    # sin(r) ~= r + r * u * (S1 + u * (S2 + u * (S3 + u * S4))), u = r^2, |r| <= pi/2
    _S1 = tl.constexpr(-0.16666647791862488)
    _S2 = tl.constexpr(0.008332899771630764)
    _S3 = tl.constexpr(-0.00019800900190602988)
    _S4 = tl.constexpr(2.590491931186989e-06)
    # cos(r) ~= C0 + u * (C1 + u * (C2 + u * (C3 + u * C4)))
    _C0 = tl.constexpr(0.9999999403953552)
    _C1 = tl.constexpr(-0.4999990463256836)
    _C2 = tl.constexpr(0.04166358709335327)
    _C3 = tl.constexpr(-0.001385372132062912)
    _C4 = tl.constexpr(2.3154247173806652e-05)
    SNAKE_EPS = tl.constexpr(EPS)
    # fp16/bf16 outputs take the sine from the SFU (below); Triton's interpreter cannot run inline PTX
    _SFU = tl.constexpr(not TRITON_INTERPRET)

    @triton.jit
    def _reduce_by_pi(y):
        """y - k*pi with k = round(y/pi): |r| <= pi/2, and sin^2(r) = sin^2(y), sin(2r) = sin(2y)."""
        k = tl.floor(y * _INV_PI + 0.5)
        r = y - k * _PI_A
        r = r - k * _PI_B
        return r - k * _PI_C

    @triton.jit
    def _sin_reduced(r):
        u = r * r
        p = _S3 + u * _S4
        p = _S2 + u * p
        p = _S1 + u * p
        return r + (r * u) * p

    @triton.jit
    def _sin_sfu(y):
        """sin(y) from the SFU: sin.approx.f32 (SASS FMUL.RZ + MUFU.SIN), absolute error ~2^-21 on
        [-pi, pi], and the argument's own fp32 rounding beyond. In a snake, sin^2(a x) / a then errs by
        2 |sin| err / a <= 2 |x| err: relative to x whatever alpha is, far below fp16's and bf16's
        rounding (decodes' SNR against upstream float32 within 0.03 dB; docs/kernels.md). 5 instructions
        where the exact reduction and polynomial take 14: long fp16 decodes ~4% faster."""
        return tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [y], dtype=tl.float32, is_pure=True,
                                         pack=1)

    @triton.jit
    def snake_sine(y, STORED: tl.constexpr):
        """sin(y) for a snake whose result is stored as STORED (a dtype): from the SFU for fp16/bf16,
        the exact range reduction and polynomial for float32 (float32 decodes stay >= 100 dB)."""
        if STORED.primitive_bitwidth < 32 and _SFU:
            s = _sin_sfu(y)
        else:
            s = _sin_reduced(_reduce_by_pi(y))
        return s

    @triton.jit
    def _cos_reduced(r):
        u = r * r
        p = _C3 + u * _C4
        p = _C2 + u * p
        p = _C1 + u * p
        return _C0 + u * p

    @triton.jit
    def _tile(pid, n_rows, C, T, n_t_blocks, ROWS: tl.constexpr, BLOCK_T: tl.constexpr):
        """A program's ROWS x BLOCK_T tile of the [B*C, T] view: its rows, channels, batches, columns."""
        row_block = pid // n_t_blocks
        t_block = pid - row_block * n_t_blocks
        rows = row_block * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_rows
        chan = rows % C  # per row, never per element
        batch = rows // C
        cols = t_block * BLOCK_T + tl.arange(0, BLOCK_T)
        mask = row_ok[:, None] & (cols < T)[None, :]
        return rows, row_ok, chan, batch, cols, mask, t_block

    @triton.jit
    def _snake_fwd_kernel(
        x_ptr, alpha_ptr, out_ptr,
        n_rows, C, T, n_t_blocks,
        stride_xb, stride_xc, stride_xt,
        ROWS: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr,
    ):
        await_previous_kernel(PDL)
        rows, row_ok, chan, batch, cols, mask, _ = _tile(
            tl.program_id(0), n_rows, C, T, n_t_blocks, ROWS, BLOCK_T
        )
        alpha = tl.load(alpha_ptr + chan, mask=row_ok, other=1.0).to(tl.float32)
        inv_alpha = 1.0 / (alpha + SNAKE_EPS)
        x_row = batch.to(tl.int64) * stride_xb + chan.to(tl.int64) * stride_xc
        x = tl.load(x_ptr + x_row[:, None] + (cols * stride_xt)[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        s = snake_sine(alpha[:, None] * x, out_ptr.dtype.element_ty)
        y = x + inv_alpha[:, None] * (s * s)
        out_row = rows.to(tl.int64) * T
        tl.store(out_ptr + out_row[:, None] + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _snake_bwd_kernel(
        grad_ptr, x_ptr, alpha_ptr, dx_ptr, dalpha_partial_ptr,
        n_rows, C, T, n_t_blocks,
        stride_gb, stride_gc, stride_gt,
        stride_xb, stride_xc, stride_xt,
        ROWS: tl.constexpr, BLOCK_T: tl.constexpr,
    ):
        rows, row_ok, chan, batch, cols, mask, t_block = _tile(
            tl.program_id(0), n_rows, C, T, n_t_blocks, ROWS, BLOCK_T
        )
        alpha = tl.load(alpha_ptr + chan, mask=row_ok, other=1.0).to(tl.float32)
        inv_alpha = 1.0 / (alpha + SNAKE_EPS)
        dx_scale = alpha * inv_alpha  # d/dx of sin^2(ax)/(a+eps) is sin(2ax) * a/(a+eps)
        b64 = batch.to(tl.int64)
        c64 = chan.to(tl.int64)
        x_row = b64 * stride_xb + c64 * stride_xc
        g_row = b64 * stride_gb + c64 * stride_gc
        x = tl.load(x_ptr + x_row[:, None] + (cols * stride_xt)[None, :], mask=mask, other=0.0)
        g = tl.load(grad_ptr + g_row[:, None] + (cols * stride_gt)[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        g = g.to(tl.float32)
        r = _reduce_by_pi(alpha[:, None] * x)
        s = _sin_reduced(r)
        sin_2ax = 2.0 * s * _cos_reduced(r)
        dx = g * (1.0 + sin_2ax * dx_scale[:, None])
        out_row = rows.to(tl.int64) * T
        tl.store(dx_ptr + out_row[:, None] + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        # masked lanes load x = g = 0, so they add exactly 0 to the partial sums
        inv = inv_alpha[:, None]
        dalpha = g * inv * (x * sin_2ax - (s * s) * inv)
        tl.store(dalpha_partial_ptr + rows.to(tl.int64) * n_t_blocks + t_block, tl.sum(dalpha, axis=1), mask=row_ok)


def snake_reference(x: Tensor, alpha: Tensor) -> Tensor:
    """Upstream's formula in plain torch: the readable definition and the fallback path.

    x: [B, C, T]; alpha: [C] or [1, C, 1]. Computes in float32 (float64 for float64 input), as the
    kernel does, and returns x's dtype and shape.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x.to(compute)
    a = alpha.reshape(1, -1, 1).to(compute)
    return (xc + (a + EPS).reciprocal() * torch.sin(a * xc).pow(2)).to(x.dtype)


def snake_backward_reference(grad: Tensor, x: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor]:
    """Analytic gradients of :func:`snake_reference`: (dx in x's dtype, dalpha float [C])."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x.to(compute)
    g = grad.to(compute)
    a = alpha.reshape(1, -1, 1).to(compute)
    inv = (a + EPS).reciprocal()
    sin_2ax = torch.sin(2 * a * xc)
    dx = g * (1 + sin_2ax * a * inv)
    dalpha = (g * inv * (xc * sin_2ax - torch.sin(a * xc).pow(2) * inv)).sum(dim=(0, 2))
    return dx.to(x.dtype), dalpha


def _launch_config(n_rows: int, T: int, elem_bytes: int, backward: bool = False) -> tuple[int, int, int]:
    """(ROWS, BLOCK_T, num_warps) for a [n_rows, T] problem.

    Tiles of 8 KB of x (forward) or 2,048 elements (backward, which also streams g and dx) were the
    fastest or within noise of it in a sweep (docs/measurements.md); small
    tensors get smaller tiles so they still spread over the SMs. Long rows get one-row tiles, short
    rows are stacked ROWS to a tile so no lanes idle.
    """
    if interpreter_configs():  # the interpreter pays per program, not per element: few big tiles
        tile = 1 << 16
    else:
        tile = 2048 if backward else 8192 // elem_bytes
        tile = max(1024, min(tile, triton.next_power_of_2(max(1, n_rows * T // 512))))
    block_t = min(triton.next_power_of_2(T), tile)
    rows = min(triton.next_power_of_2(n_rows), max(1, tile // block_t))
    num_warps = 8 if tile >= 4096 and not backward else 4
    return rows, block_t, num_warps


def _check_strides(x: Tensor) -> Tensor:
    # column offsets are int32 in the kernel; a huge non-unit T stride is rare: copy instead
    if x.stride(2) != 1 and x.shape[2] * x.stride(2) >= 2**31:
        return x.contiguous()
    return x


def _forward_triton(x: Tensor, alpha: Tensor, config: tuple[int, int, int] | None = None) -> Tensor:
    B, C, T = x.shape
    out = torch.empty((B, C, T), dtype=x.dtype, device=x.device)
    n_rows = B * C
    if out.numel() == 0:
        return out
    x = _check_strides(x)
    rows, block_t, num_warps = config or _launch_config(n_rows, T, x.element_size())
    n_t_blocks = triton.cdiv(T, block_t)
    grid = (triton.cdiv(n_rows, rows) * n_t_blocks,)
    _snake_fwd_kernel[grid](
        x, alpha.reshape(-1), out, n_rows, C, T, n_t_blocks, *x.stride(),
        ROWS=rows, BLOCK_T=block_t, num_warps=num_warps, **launch_flags(x.device, grid[0]),
    )
    return out


def _backward_triton(
    grad: Tensor, x: Tensor, alpha: Tensor, config: tuple[int, int, int] | None = None
) -> tuple[Tensor, Tensor]:
    B, C, T = x.shape
    dx = torch.empty((B, C, T), dtype=x.dtype, device=x.device)
    n_rows = B * C
    if dx.numel() == 0:
        return dx, torch.zeros(C, dtype=torch.float32, device=x.device)
    x, grad = _check_strides(x), _check_strides(grad)
    rows, block_t, num_warps = config or _launch_config(n_rows, T, x.element_size(), backward=True)
    n_t_blocks = triton.cdiv(T, block_t)
    partial = torch.empty((n_rows, n_t_blocks), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n_rows, rows) * n_t_blocks,)
    _snake_bwd_kernel[grid](
        grad, x, alpha.reshape(-1), dx, partial, n_rows, C, T, n_t_blocks,
        *grad.stride(), *x.stride(),
        ROWS=rows, BLOCK_T=block_t, num_warps=num_warps,
    )
    # fixed-shape torch reduction: no atomics, so the result is the same bit for bit on every run
    return dx, partial.view(B, C, n_t_blocks).sum(dim=(0, 2))


def kernel_applies(x: Tensor) -> bool:
    return x.dtype in KERNEL_DTYPES and runs_triton(x)


def _forward(x: Tensor, alpha: Tensor) -> Tensor:
    if kernel_applies(x):
        return _forward_triton(x, alpha)
    return snake_reference(x, alpha).contiguous()


@torch.library.custom_op("snac_fast::snake", mutates_args=())
def _snake_op(x: Tensor, alpha: Tensor) -> Tensor:
    return _forward(x, alpha)


@_snake_op.register_fake
def _snake_op_fake(x: Tensor, alpha: Tensor) -> Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("snac_fast::snake_backward", mutates_args=())
def _snake_backward_op(grad: Tensor, x: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor]:
    if kernel_applies(x):
        dx, dalpha = _backward_triton(grad, x, alpha)
    else:
        dx, dalpha = snake_backward_reference(grad, x, alpha)
        dx = dx.contiguous()
    return dx, dalpha.to(alpha.dtype).reshape(alpha.shape)


@_snake_backward_op.register_fake
def _snake_backward_op_fake(grad: Tensor, x: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), alpha.new_empty(alpha.shape)


def _setup_context(ctx, inputs, output) -> None:
    x, alpha = inputs
    ctx.save_for_backward(x, alpha)  # only the input: sin terms are recomputed, not stored


def _backward(ctx, grad: Tensor):
    x, alpha = ctx.saved_tensors
    dx, dalpha = _snake_backward_op(grad, x, alpha)
    return (dx if ctx.needs_input_grad[0] else None, dalpha if ctx.needs_input_grad[1] else None)


_snake_op.register_autograd(_backward, setup_context=_setup_context)


def check_snake_args(x: Tensor, alpha: Tensor) -> None:
    """Raise ValueError naming the problem when (x, alpha) is not a valid snake input."""
    if not isinstance(x, Tensor) or not isinstance(alpha, Tensor):
        raise ValueError(f"snake expects tensors, got x={type(x).__name__}, alpha={type(alpha).__name__}")
    if x.dim() != 3:
        raise ValueError(f"snake expects x shaped [B, C, T], got {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"snake expects a floating x (float16, bfloat16, float32), got {x.dtype}")
    if not alpha.dtype.is_floating_point:
        raise ValueError(f"snake expects a floating alpha, got {alpha.dtype}")
    C = x.shape[1]
    if tuple(alpha.shape) not in ((C,), (1, C, 1)):
        raise ValueError(f"alpha must be shaped [{C}] or [1, {C}, 1] for x with {C} channels, got {tuple(alpha.shape)}")
    if x.device != alpha.device:
        raise ValueError(f"x is on {x.device} but alpha is on {alpha.device}; move both to one device")


def snake(x: Tensor, alpha: Tensor) -> Tensor:
    """Snake activation ``x + sin^2(alpha * x) / (alpha + 1e-9)``, differentiable in x and alpha.

    Args:
        x: [B, C, T], float16 / bfloat16 / float32 (float64 runs the torch reference), any strides.
        alpha: [C] or [1, C, 1], any float dtype, same device as x.
    Returns:
        [B, C, T] contiguous tensor in x's dtype. CUDA runs the Triton kernel; CPU runs it through
        Triton's interpreter when TRITON_INTERPRET=1, else :func:`snake_reference`.
    """
    check_snake_args(x, alpha)
    if through_op(x, alpha):
        return _snake_op(x, alpha)  # the registered op: autograd, torch.compile and export see it
    return _forward(x, alpha)
