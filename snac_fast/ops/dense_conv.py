"""A dense Conv1d (groups = 1) of any kernel size, stride and zero padding as a Triton implicit
GEMM, beside its torch reference: the encoder's input conv (one channel in) and its strided
downsampling convs (kernel 2s, stride s).

cuDNN runs these in NHWC: given [B, C, T] tensors it wraps its kernel in two layout transforms and
adds the bias in a third pass (over a third of an encode; docs/measurements.md). Here the input
is read channels-last ([B, T, C] memory, which the encoder's residual unit before the conv writes):
the K * C_in values that output step t reads, from x[t * stride - padding] on, are then contiguous,
so the conv is one GEMM of the weight [C_out, K * C_in] (columns (tap, channel)) by a strided view
of the input, zero outside the signal. The epilogue adds the bias and optionally writes the next
residual unit's input snake beside the output (the pair (y, snake(y)) from one fp32 tile).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from snac_fast.ops.common import (
    check_floating,
    check_same_device,
    compute_dtype,
    is_channels_last,
)
from snac_fast.ops.device import (
    HAS_TRITON,
    TRITON_INTERPRET,
    interpreter_configs,
    through_op,
)
from snac_fast.ops.launch import (
    first_filling,
    launch_fitting,
    launch_flags,
    wave_programs,
)
from snac_fast.ops.snake import kernel_applies, snake_reference

if HAS_TRITON:
    import triton
    import triton.language as tl

    from snac_fast.ops.common import dot_accumulate, gemm_tile, store_with_pair
    from snac_fast.ops.launch import await_previous_kernel

    @triton.jit
    def _dense_conv_kernel(
        x_ptr, w_ptr, bias_ptr, pair_alpha_ptr, out_ptr, pair_out_ptr,
        C_out, T_in, T_out, n_m_blocks, n_t_blocks,
        C_IN: tl.constexpr, KS: tl.constexpr, STRIDE: tl.constexpr, PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
        PAIR: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, K_BLOCKS: tl.constexpr, PDL: tl.constexpr,
    ):
        """x: [B, T_in, C_IN] memory. Output column t reads the KS * C_IN contiguous values from
        x[t * STRIDE - PAD, 0]: a GEMM whose K axis is (tap, channel), loaded as plain vectors."""
        await_previous_kernel(PDL)
        batch, offs_m, offs_n, offs_k, m_ok, n_ok = gemm_tile(n_m_blocks, n_t_blocks, C_out, T_out, BLOCK_M, BLOCK_N,
                                                              BLOCK_K)
        x_base = x_ptr + batch.to(tl.int64) * T_in * C_IN
        first = (offs_n.to(tl.int64) * STRIDE - PAD) * C_IN  # flat index of each column's first input value
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(K_BLOCKS):
            k = kb * BLOCK_K + offs_k
            k_ok = k < KS * C_IN
            a = tl.load(w_ptr + offs_m[:, None] * (KS * C_IN) + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            flat = first[None, :] + k[:, None]  # inside the signal exactly when 0 <= flat < T_in * C_IN
            b = tl.load(x_base + flat, mask=k_ok[:, None] & n_ok[None, :] & (flat >= 0) & (flat < T_in.to(tl.int64) * C_IN), other=0.0)
            acc = dot_accumulate(acc, a, b, IEEE, UPCAST)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_m, mask=m_ok, other=0.0).to(tl.float32)[:, None]
        out_offs = batch.to(tl.int64) * C_out * T_out + offs_m[:, None].to(tl.int64) * T_out + offs_n[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        store_with_pair(acc, out_ptr, pair_out_ptr, pair_alpha_ptr, out_offs, mask, offs_m, m_ok, PAIR)


def output_length(T_in: int, kernel: int, stride: int, padding: int) -> int:
    return (T_in + 2 * padding - kernel) // stride + 1


def pack_dense_weight(weight: Tensor) -> Tensor:
    """Conv1d weight [C_out, C_in, K] -> the kernel's [C_out, K * C_in], column ``tap * C_in + c``."""
    return weight.permute(0, 2, 1).reshape(weight.shape[0], -1).contiguous()


def dense_conv_reference(x: Tensor, weight: Tensor, bias: Tensor | None, stride: int, padding: int,
                         pair_alpha: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """``conv1d(x, weight, bias, stride, padding)`` in float32 (float64 for float64 x), rounded to
    x's dtype; with ``pair_alpha`` the pair (y, snake(y)) both from the unrounded y."""
    compute = compute_dtype(x)
    y = F.conv1d(x.to(compute), weight.to(compute), None if bias is None else bias.to(compute), stride, padding)
    if pair_alpha is None:
        return y.to(x.dtype)
    return y.to(x.dtype), snake_reference(y, pair_alpha.to(compute).reshape(1, -1, 1)).to(x.dtype)


# (BLOCK_M, BLOCK_N) in order of preference: the biggest tile whose grid still fills the GPU
_DENSE_TILES = ((128, 128), (128, 64), (64, 64), (64, 32), (32, 32), (16, 32))


def _dense_config(B: int, C_out: int, K_total: int, T_out: int, elem_bytes: int,
                  device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); K_total = taps x input channels."""
    block_k = max(16, min(64, triton.next_power_of_2(K_total)))
    if interpreter_configs():
        return (max(16, min(128, triton.next_power_of_2(C_out))), max(16, min(512, triton.next_power_of_2(T_out))),
                block_k, 4, 3)
    cap_m, cap_n = max(16, triton.next_power_of_2(C_out)), max(16, triton.next_power_of_2(T_out))
    tiles = [(min(m, cap_m), min(n, cap_n)) for m, n in _DENSE_TILES]
    block_m, block_n = first_filling(tiles, lambda t: B * triton.cdiv(C_out, t[0]) * triton.cdiv(T_out, t[1]),
                                     wave_programs(device))
    if elem_bytes == 4:
        block_k = min(block_k, 32)
    return block_m, block_n, block_k, 8 if block_m * block_n >= 16384 else 4, 3 if elem_bytes < 4 else 2


def _dense_conv_triton(x, packed, bias, stride, padding, pair_alpha, config=None):
    B, C_in, T_in = x.shape
    C_out, K_total = packed.shape
    K = K_total // C_in
    T_out = output_length(T_in, K, stride, padding)
    out = torch.empty((B, C_out, T_out), dtype=x.dtype, device=x.device)
    pair_out = torch.empty_like(out) if pair_alpha is not None else None
    if out.numel() == 0:
        return out if pair_out is None else (out, pair_out)
    if not is_channels_last(x):  # the kernel reads [B, T, C] memory (the same as [B, C, T] for one channel)
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    config = config or _dense_config(B, C_out, K_total, T_out, x.element_size(), x.device)

    def launch(config):
        block_m, block_n, block_k, warps, stages = config
        n_m, n_t = triton.cdiv(C_out, block_m), triton.cdiv(T_out, block_n)
        grid = (B * n_m * n_t,)
        _dense_conv_kernel[grid](
            x, packed, packed if bias is None else bias, packed if pair_alpha is None else pair_alpha.reshape(-1), out,
            out if pair_out is None else pair_out,
            C_out, T_in, T_out, n_m, n_t,
            C_IN=C_in, KS=K, STRIDE=stride, PAD=padding, HAS_BIAS=bias is not None, PAIR=pair_alpha is not None,
            IEEE=x.dtype == torch.float32, UPCAST=TRITON_INTERPRET and x.dtype == torch.bfloat16,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, K_BLOCKS=triton.cdiv(K_total, block_k),
            num_warps=warps, num_stages=stages, **launch_flags(x.device, grid[0]),
        )
    launch_fitting(("dense_conv", x.device, x.dtype), config, launch)
    return out if pair_out is None else (out, pair_out)


def _dense_conv(x: Tensor, weight: Tensor, packed: Tensor, bias: Tensor | None, stride: int, padding: int,
                pair_alpha: Tensor | None) -> list[Tensor]:
    if kernel_applies(x):
        out = _dense_conv_triton(x, packed, bias, stride, padding, pair_alpha)
    else:
        out = dense_conv_reference(x, weight, bias, stride, padding, pair_alpha)
    return [t.contiguous() for t in (out if isinstance(out, tuple) else (out,))]


_dense_conv_op = torch.library.custom_op("snac_fast::dense_conv", _dense_conv, mutates_args=())


@_dense_conv_op.register_fake
def _(x, weight, packed, bias, stride, padding, pair_alpha):
    shape = (x.shape[0], weight.shape[0], output_length(x.shape[2], weight.shape[2], stride, padding))
    return [x.new_empty(shape) for _ in range(1 if pair_alpha is None else 2)]


def dense_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: int = 1, padding: int = 0, *,
                 pair_alpha: Tensor | None = None, packed: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """``conv1d(x, weight, bias, stride, padding)`` (groups 1, dilation 1), and with ``pair_alpha``
    the pair (y, snake(y, pair_alpha)) from one kernel (a residual unit's input and its snake).

    x: [B, C_in, T], contiguous or channels-last ([B, T, C_in] memory); weight: [C_out, C_in, K];
    bias, pair_alpha: [C_out]. packed: :func:`pack_dense_weight` of weight in x's dtype (pass it to
    avoid repacking per call). Returns [B, C_out, (T + 2 padding - K) // stride + 1] contiguous in
    x's dtype (each tensor of the pair). Inference only.
    """
    check_floating(x, "x")
    check_floating(weight, "weight")
    C_in = x.shape[1]
    if weight.dim() != 3 or weight.shape[1] != C_in:
        raise ValueError(f"weight must be [C_out, {C_in}, K], got {tuple(weight.shape)}")
    C_out, _, K = weight.shape
    if stride < 1 or padding < 0:
        raise ValueError(f"needs stride >= 1 and padding >= 0, got {stride}, {padding}")
    if output_length(x.shape[2], K, stride, padding) < 1:
        raise ValueError(f"input of {x.shape[2]} samples is shorter than the kernel ({K}, padding {padding})")
    for name, v in (("bias", bias), ("pair_alpha", pair_alpha)):
        if v is not None and v.numel() != C_out:
            raise ValueError(f"{name} needs {C_out} values (one per output channel), got {v.numel()}")
    if packed is None:
        packed = pack_dense_weight(weight.to(x.dtype))
    check_same_device(x.device, weight, packed, bias, pair_alpha)
    run = _dense_conv_op if through_op(x, weight, bias, pair_alpha) else _dense_conv
    out = run(x, weight, packed, bias, int(stride), int(padding), pair_alpha)
    return out[0] if pair_alpha is None else (out[0], out[1])
