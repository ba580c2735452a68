"""Decoder convolutions as Triton kernels, each beside its plain-torch reference.

``depthwise_conv_snake``: the residual unit's middle, ``snake(depthwise_conv(x) + bias, alpha)`` with a
dilated K-tap per-channel filter and zero padding (K-1)*dilation/2, in one pass (taps and alpha in
registers, fp32 accumulation; the shifted loads hit L1/L2, so x is read from memory about once).

``transposed_conv``: SNAC's upsampling ConvTranspose1d (kernel 2*stride) as ``stride`` phase GEMMs:
output t = i*stride + q - padding takes taps q and q+stride from inputs i and i-1, so each phase is
two [C_out x C_in] @ [C_in x N] products, bias fused, written straight into the NCL output (cuDNN
converts NCL <-> NHWC around its kernel, three extra passes over the data).

``pointwise_conv``: a 1x1 convolution as a GEMM with its epilogue fused,
``out = residual + scale * (W @ h + bias)``, where residual ([B, C_out, T]), scale ([B, 1, T], the
NoiseBlock's noise) and bias are each optional: the residual unit's tail (conv + add) and the whole
NoiseBlock (``x + noise * (W @ x)``) are each one kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from snac_fast.ops._runtime import HAS_TRITON, TRITON_INTERPRET, runs_triton
from snac_fast.ops.snake import EPS, KERNEL_DTYPES

if HAS_TRITON:
    import triton
    import triton.language as tl

    from snac_fast.ops.snake import _EPS, _reduce_by_pi, _sin_reduced

    @triton.jit
    def _depthwise_conv_snake_kernel(
        x_ptr, w_ptr, bias_ptr, alpha_ptr, out_ptr,
        n_rows, C, T, n_t_blocks,
        K: tl.constexpr, DILATION: tl.constexpr, HAS_BIAS: tl.constexpr, SNAKE: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_T: tl.constexpr,
    ):
        pid = tl.program_id(0)
        row_block = pid // n_t_blocks
        t_block = pid - row_block * n_t_blocks
        rows = row_block * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_rows
        chan = rows % C
        cols = t_block * BLOCK_T + tl.arange(0, BLOCK_T)
        col_ok = cols < T
        row_base = rows.to(tl.int64) * T
        acc = tl.zeros((ROWS, BLOCK_T), dtype=tl.float32)
        for k in tl.static_range(K):
            shift = (k - (K - 1) // 2) * DILATION
            src = cols + shift
            m = row_ok[:, None] & ((src >= 0) & (src < T))[None, :]  # zero padding
            w = tl.load(w_ptr + chan * K + k, mask=row_ok, other=0.0).to(tl.float32)
            v = tl.load(x_ptr + row_base[:, None] + src[None, :], mask=m, other=0.0).to(tl.float32)
            acc += w[:, None] * v
        if HAS_BIAS:
            acc += tl.load(bias_ptr + chan, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        if SNAKE:
            alpha = tl.load(alpha_ptr + chan, mask=row_ok, other=1.0).to(tl.float32)
            s = _sin_reduced(_reduce_by_pi(alpha[:, None] * acc))
            acc = acc + (1.0 / (alpha + _EPS))[:, None] * (s * s)
        mask = row_ok[:, None] & col_ok[None, :]
        tl.store(out_ptr + row_base[:, None] + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _pointwise_conv_kernel(
        w_ptr, h_ptr, bias_ptr, res_ptr, scale_ptr, out_ptr,
        C_out, C_in, T, n_m_blocks, n_t_blocks,
        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, IEEE: tl.constexpr,
        UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_BLOCKS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        t_block = pid % n_t_blocks  # t fastest: neighbouring programs stream neighbouring columns
        rest = pid // n_t_blocks
        m_block = rest % n_m_blocks
        batch = rest // n_m_blocks
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = t_block * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < C_out
        n_ok = offs_n < T
        h_base = h_ptr + batch.to(tl.int64) * C_in * T
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(K_BLOCKS):  # a layer's C_in is fixed: a compile-time trip count
            k = kb * BLOCK_K + offs_k
            k_ok = k < C_in
            a = tl.load(w_ptr + offs_m[:, None] * C_in + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(h_base + k[:, None].to(tl.int64) * T + offs_n[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:  # Triton's interpreter multiplies bf16 as raw bits (numpy has no bf16)
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE or UPCAST:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_m, mask=m_ok, other=0.0).to(tl.float32)[:, None]
        if HAS_SCALE:
            acc *= tl.load(scale_ptr + batch.to(tl.int64) * T + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out_offs = batch.to(tl.int64) * C_out * T + offs_m[:, None].to(tl.int64) * T + offs_n[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        if HAS_RES:
            acc += tl.load(res_ptr + out_offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


    @triton.jit
    def _transposed_conv_kernel(
        x_ptr, w_ptr, bias_ptr, out_ptr,
        C_in, C_out, T_in, T_out, PAD, n_m_blocks, n_i_blocks,
        STRIDE: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_BLOCKS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        i_block = pid % n_i_blocks
        rest = pid // n_i_blocks
        m_block = rest % n_m_blocks
        batch = rest // n_m_blocks
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_i = i_block * BLOCK_N + tl.arange(0, BLOCK_N)  # input positions; output t = i*S + q - PAD
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < C_out
        x_base = x_ptr + batch.to(tl.int64) * C_in * T_in
        out_base = out_ptr + batch.to(tl.int64) * C_out * T_out
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_m, mask=m_ok, other=0.0).to(tl.float32)
        for q in tl.static_range(STRIDE):
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kb in range(K_BLOCKS):
                k = kb * BLOCK_K + offs_k
                k_ok = k < C_in
                w_mask = m_ok[:, None] & k_ok[None, :]
                w_rows = offs_m[:, None] * C_in + k[None, :]  # packed weight: [2*S, C_out, C_in]
                w_now = tl.load(w_ptr + q * C_out * C_in + w_rows, mask=w_mask, other=0.0)
                w_prev = tl.load(w_ptr + (q + STRIDE) * C_out * C_in + w_rows, mask=w_mask, other=0.0)
                x_rows = x_base + k[:, None].to(tl.int64) * T_in
                ok_now = k_ok[:, None] & (offs_i < T_in)[None, :]
                ok_prev = k_ok[:, None] & ((offs_i >= 1) & (offs_i - 1 < T_in))[None, :]
                x_now = tl.load(x_rows + offs_i[None, :], mask=ok_now, other=0.0)
                x_prev = tl.load(x_rows + (offs_i - 1)[None, :], mask=ok_prev, other=0.0)
                if UPCAST:  # the interpreter multiplies bf16 as raw bits
                    w_now, w_prev = w_now.to(tl.float32), w_prev.to(tl.float32)
                    x_now, x_prev = x_now.to(tl.float32), x_prev.to(tl.float32)
                if IEEE or UPCAST:
                    acc += tl.dot(w_now, x_now, input_precision="ieee")
                    acc += tl.dot(w_prev, x_prev, input_precision="ieee")
                else:
                    acc += tl.dot(w_now, x_now)
                    acc += tl.dot(w_prev, x_prev)
            if HAS_BIAS:
                acc += bias[:, None]
            t = offs_i * STRIDE + q - PAD
            mask = m_ok[:, None] & ((t >= 0) & (t < T_out))[None, :]
            tl.store(out_base + offs_m[:, None].to(tl.int64) * T_out + t[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


# --- references ---------------------------------------------------------------------------------

def depthwise_conv_snake_reference(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int,
                                   alpha: Tensor | None) -> Tensor:
    """``snake(conv1d(x, weight, bias, padding=(K-1)*dilation//2, dilation, groups=C), alpha)`` in
    float32 (float64 for float64 input), returned in x's dtype. weight: [C, 1, K]."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    K = weight.shape[-1]
    y = F.conv1d(x.to(compute), weight.to(compute), None if bias is None else bias.to(compute),
                 padding=(K - 1) * dilation // 2, dilation=dilation, groups=x.shape[1])
    if alpha is not None:
        a = alpha.reshape(1, -1, 1).to(compute)
        y = y + (a + EPS).reciprocal() * torch.sin(a * y).pow(2)
    return y.to(x.dtype)


def pointwise_conv_reference(h: Tensor, weight: Tensor, bias: Tensor | None = None,
                             residual: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    """``residual + scale * (conv1d(h, weight) + bias)`` in float32 (float64 for float64 input)."""
    compute = torch.float64 if h.dtype == torch.float64 else torch.float32
    y = F.conv1d(h.to(compute), weight.to(compute), None if bias is None else bias.to(compute))
    if scale is not None:
        y = y * scale.to(compute)
    if residual is not None:
        y = y + residual.to(compute)
    return y.to(h.dtype)


def transposed_conv_reference(x: Tensor, weight: Tensor, bias: Tensor | None, stride: int, padding: int,
                              output_padding: int) -> Tensor:
    """``conv_transpose1d`` in float32 (float64 for float64 input), returned in x's dtype."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = F.conv_transpose1d(x.to(compute), weight.to(compute), None if bias is None else bias.to(compute),
                           stride=stride, padding=padding, output_padding=output_padding)
    return y.to(x.dtype)


def pack_transposed_weight(weight: Tensor) -> Tensor:
    """ConvTranspose1d weight [C_in, C_out, K] -> [K, C_out, C_in] contiguous (the kernel's layout)."""
    return weight.permute(2, 1, 0).contiguous()


# --- launchers ----------------------------------------------------------------------------------

def _dw_config(n_rows: int, T: int) -> tuple[int, int, int]:
    tile = 1 << 16 if TRITON_INTERPRET else 2048
    block_t = min(triton.next_power_of_2(T), tile)
    rows = min(triton.next_power_of_2(n_rows), max(1, tile // block_t))
    return rows, block_t, 4


def _depthwise_conv_snake_triton(x, weight, bias, dilation, alpha):
    B, C, T = x.shape
    out = torch.empty((B, C, T), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x = x.contiguous()
    K = weight.shape[-1]
    rows, block_t, warps = _dw_config(B * C, T)
    n_t_blocks = triton.cdiv(T, block_t)
    grid = (triton.cdiv(B * C, rows) * n_t_blocks,)
    w = weight.reshape(C, K)
    _depthwise_conv_snake_kernel[grid](
        x, w, w if bias is None else bias, w if alpha is None else alpha.reshape(-1), out,
        B * C, C, T, n_t_blocks,
        K=K, DILATION=dilation, HAS_BIAS=bias is not None, SNAKE=alpha is not None,
        ROWS=rows, BLOCK_T=block_t, num_warps=warps,
    )
    return out


def _pw_config(C_out: int, C_in: int, T: int) -> tuple[int, int, int, int, int]:
    block_m = max(16, min(128, triton.next_power_of_2(C_out)))
    block_k = max(16, min(64, triton.next_power_of_2(C_in)))
    block_n = max(16, min(1024 if TRITON_INTERPRET else 128, triton.next_power_of_2(T)))
    return block_m, block_n, block_k, 4, 3


def _pointwise_conv_triton(h, weight, bias, residual, scale):
    B, C_in, T = h.shape
    C_out = weight.shape[0]
    out = torch.empty((B, C_out, T), dtype=h.dtype, device=h.device)
    if out.numel() == 0:
        return out
    h = h.contiguous()
    w = weight.reshape(C_out, C_in).contiguous()
    residual = None if residual is None else residual.contiguous()
    scale = None if scale is None else scale.contiguous()
    block_m, block_n, block_k, warps, stages = _pw_config(C_out, C_in, T)
    n_m, n_t = triton.cdiv(C_out, block_m), triton.cdiv(T, block_n)
    _pointwise_conv_kernel[(B * n_m * n_t,)](
        w, h, w if bias is None else bias, out if residual is None else residual, out if scale is None else scale, out,
        C_out, C_in, T, n_m, n_t,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, HAS_SCALE=scale is not None,
        IEEE=h.dtype == torch.float32, UPCAST=TRITON_INTERPRET and h.dtype == torch.bfloat16,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, K_BLOCKS=triton.cdiv(C_in, block_k),
        num_warps=warps, num_stages=stages,
    )
    return out


def _transposed_conv_triton(x, packed_weight, bias, stride, padding, output_padding):
    B, C_in, T_in = x.shape
    K, C_out, _ = packed_weight.shape
    T_out = (T_in - 1) * stride - 2 * padding + K + output_padding
    out = torch.empty((B, C_out, T_out), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x = x.contiguous()
    block_m = max(16, min(64, triton.next_power_of_2(C_out)))
    block_k = max(16, min(64, triton.next_power_of_2(C_in)))
    n_inputs = T_in + 2  # outputs near the end are reached from i = T_in (its x is padding)
    block_n = max(16, min(1024 if TRITON_INTERPRET else 64, triton.next_power_of_2(n_inputs)))
    n_m, n_i = triton.cdiv(C_out, block_m), triton.cdiv(n_inputs, block_n)
    _transposed_conv_kernel[(B * n_m * n_i,)](
        x, packed_weight, packed_weight if bias is None else bias, out,
        C_in, C_out, T_in, T_out, padding, n_m, n_i,
        STRIDE=stride, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        UPCAST=TRITON_INTERPRET and x.dtype == torch.bfloat16,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, K_BLOCKS=triton.cdiv(C_in, block_k), num_warps=4,
    )
    return out


def _kernel_applies(x: Tensor) -> bool:
    return x.dtype in KERNEL_DTYPES and runs_triton(x)


# --- torch.library ops (visible to torch.compile) and the public functions --------------------

@torch.library.custom_op("snac_fast::depthwise_conv_snake", mutates_args=())
def _depthwise_conv_snake_op(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int,
                             alpha: Tensor | None) -> Tensor:
    if _kernel_applies(x):
        return _depthwise_conv_snake_triton(x, weight, bias, dilation, alpha)
    return depthwise_conv_snake_reference(x, weight, bias, dilation, alpha).contiguous()


@_depthwise_conv_snake_op.register_fake
def _(x, weight, bias, dilation, alpha):
    return x.new_empty(x.shape)


@torch.library.custom_op("snac_fast::pointwise_conv", mutates_args=())
def _pointwise_conv_op(h: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None,
                       scale: Tensor | None) -> Tensor:
    if _kernel_applies(h):
        return _pointwise_conv_triton(h, weight, bias, residual, scale)
    return pointwise_conv_reference(h, weight, bias, residual, scale).contiguous()


@_pointwise_conv_op.register_fake
def _(h, weight, bias, residual, scale):
    return h.new_empty((h.shape[0], weight.shape[0], h.shape[2]))


@torch.library.custom_op("snac_fast::transposed_conv", mutates_args=())
def _transposed_conv_op(x: Tensor, packed_weight: Tensor, bias: Tensor | None, stride: int, padding: int,
                        output_padding: int) -> Tensor:
    if _kernel_applies(x):
        return _transposed_conv_triton(x, packed_weight, bias, stride, padding, output_padding)
    weight = packed_weight.permute(2, 1, 0)
    return transposed_conv_reference(x, weight, bias, stride, padding, output_padding).contiguous()


@_transposed_conv_op.register_fake
def _(x, packed_weight, bias, stride, padding, output_padding):
    K, C_out, _ = packed_weight.shape
    return x.new_empty((x.shape[0], C_out, (x.shape[2] - 1) * stride - 2 * padding + K + output_padding))


def _check(x: Tensor, what: str, dims: int = 3) -> None:
    if not isinstance(x, Tensor) or x.dim() != dims or not x.dtype.is_floating_point:
        raise ValueError(f"{what} must be a floating tensor with {dims} dims, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")


def depthwise_conv_snake(x: Tensor, weight: Tensor, bias: Tensor | None = None, dilation: int = 1,
                         alpha: Tensor | None = None) -> Tensor:
    """Dilated depthwise conv1d ("same" zero padding) + bias, then Snake with ``alpha`` if given.

    x: [B, C, T]; weight: [C, 1, K] with K odd; bias, alpha: [C] (alpha also [1, C, 1]).
    Returns [B, C, T] contiguous in x's dtype. Inference only (no autograd).
    """
    _check(x, "x")
    _check(weight, "weight")
    C = x.shape[1]
    if weight.shape[0] != C or weight.shape[1] != 1 or weight.shape[2] % 2 == 0:
        raise ValueError(f"depthwise weight must be [{C}, 1, K] with K odd, got {tuple(weight.shape)}")
    if bias is not None and bias.numel() != C or alpha is not None and alpha.numel() != C:
        raise ValueError(f"bias and alpha need {C} values")
    if any(t is not None and t.device != x.device for t in (weight, bias, alpha)):
        raise ValueError(f"all tensors must be on {x.device}")
    return _depthwise_conv_snake_op(x, weight, bias, int(dilation), alpha)


def pointwise_conv(h: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None,
                   scale: Tensor | None = None) -> Tensor:
    """``residual + scale * (W @ h + bias)``: a 1x1 conv with its epilogue fused.

    h: [B, C_in, T]; weight: [C_out, C_in, 1]; bias: [C_out]; residual: [B, C_out, T];
    scale: [B, 1, T]. Returns [B, C_out, T] contiguous in h's dtype. Inference only.
    """
    _check(h, "h")
    _check(weight, "weight")
    B, C_in, T = h.shape
    C_out = weight.shape[0]
    if weight.shape[1:] != (C_in, 1):
        raise ValueError(f"pointwise weight must be [C_out, {C_in}, 1], got {tuple(weight.shape)}")
    if residual is not None and tuple(residual.shape) != (B, C_out, T):
        raise ValueError(f"residual must be {(B, C_out, T)}, got {tuple(residual.shape)}")
    if scale is not None and tuple(scale.shape) != (B, 1, T):
        raise ValueError(f"scale must be {(B, 1, T)}, got {tuple(scale.shape)}")
    if any(t is not None and t.device != h.device for t in (weight, bias, residual, scale)):
        raise ValueError(f"all tensors must be on {h.device}")
    return _pointwise_conv_op(h, weight, bias, residual, scale)


def transposed_conv(x: Tensor, packed_weight: Tensor, bias: Tensor | None, stride: int, padding: int,
                    output_padding: int = 0) -> Tensor:
    """ConvTranspose1d with kernel size 2*stride (SNAC's upsampling layers), bias fused.

    x: [B, C_in, T]; packed_weight: :func:`pack_transposed_weight` of the [C_in, C_out, 2*stride]
    weight; bias: [C_out]. Returns [B, C_out, (T-1)*stride - 2*padding + 2*stride + output_padding].
    """
    _check(x, "x")
    _check(packed_weight, "packed_weight")
    K, C_out, C_in = packed_weight.shape
    if K != 2 * stride or C_in != x.shape[1]:
        raise ValueError(f"packed weight must be [2*stride={2 * stride}, C_out, {x.shape[1]}], got {tuple(packed_weight.shape)}")
    if bias is not None and bias.numel() != C_out:
        raise ValueError(f"bias needs {C_out} values")
    if any(t is not None and t.device != x.device for t in (packed_weight, bias)):
        raise ValueError(f"all tensors must be on {x.device}")
    return _transposed_conv_op(x, packed_weight, bias, int(stride), int(padding), int(output_padding))
