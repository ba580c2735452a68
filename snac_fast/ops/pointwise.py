"""1x1 convolutions as a Triton GEMM with fused epilogues, beside their torch references.


``pointwise_conv``: a 1x1 convolution as a GEMM with its epilogue fused,
``out = snake_out(residual + scale * (W @ h + bias))``, each part optional: the residual unit's tail
(conv + add, and the next layer's snake when that is absorbed) and the whole NoiseBlock
(``x + noise * (W @ x)``) are one kernel each. ``input_bias`` adds a per-channel bias to h (and to
the residual): the NoiseBlock takes over the bias of a cuDNN transposed convolution before it, which
saves cuDNN's separate bias pass over the block's largest tensor. The kernel never touches h's
tiles for it: ``W @ (h + ib) = W @ h + W @ ib``, so W @ ib joins the GEMM's bias (float32,
:func:`fold_input_bias`, which a caller may keep) and ib the residual as it is loaded
(``residual_bias``); an h tile changed in registers would leave the tensor cores' pipelined
shared-memory path.
``pointwise_conv_pair`` also stores ``snake(out)`` from the same tile: a residual unit's output and
the next unit's input snake in one kernel. Both can write in place over the residual. Inputs may be
laid out [B, C, T] or [B, T, C] in memory (``is_channels_last``: a cuDNN transposed conv's output);
``pointwise_conv(..., channels_last=True)`` writes [B, T, C] for the transposed conv after a block.
Large problems of 256+ output channels on Hopper run a second kernel whose tiles the Tensor Memory
Accelerator moves (Triton tensor descriptors), 128 x 128 on 8 warps (:func:`_tma_tile`).
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
    is_channels_last,
    maybe_snake,
    with_layout,
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
    has_tma,
    launch_choice,
    launch_fitting,
    launch_flags,
    wave_programs,
)
from snac_fast.ops.snake import kernel_applies, snake_reference

if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from snac_fast.ops.common import (
        dot_accumulate,
        gemm_tile,
        program_tile,
        snake_rows,
        store_with_pair,
    )
    from snac_fast.ops.launch import await_previous_kernel

    # T's alignment is a hint (ALIGNED: T % 8 == 0, 16-byte rows in half precision) rather than
    # Triton's divisible-by-16 specialization: lengths that are multiples of 8 but not of 16 compiled
    # a second variant of every launch (a cold start compiles each; docs/batching.md)
    @triton.jit(do_not_specialize_on_alignment=["T"])
    def _pointwise_conv_kernel(
        w_ptr, h_ptr, bias_ptr, res_ptr, scale_ptr, res_bias_ptr, alpha_out_ptr, out_ptr, pair_alpha_ptr, pair_out_ptr,
        C_out, C_in, T, n_m_blocks, n_t_blocks,
        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_RES_BIAS: tl.constexpr,
        SNAKE_OUT: tl.constexpr, PAIR: tl.constexpr, H_CL: tl.constexpr, RES_CL: tl.constexpr, OUT_CL: tl.constexpr,
        ALIGNED: tl.constexpr, IEEE: tl.constexpr,
        UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_BLOCKS: tl.constexpr, PDL: tl.constexpr,
        ROWS_FASTEST: tl.constexpr = False,
    ):
        """[B, C, T] memory, or [B, T, C] where *_CL (strides (channel, time): (T, 1), or (1, C))."""
        await_previous_kernel(PDL)
        if ALIGNED:
            T = T // 8 * 8  # the same value, known to the compiler as a multiple of 8 (multiple_of on an argument is not)
        batch, offs_m, offs_n, offs_k, m_ok, n_ok = gemm_tile(n_m_blocks, n_t_blocks, C_out, T, BLOCK_M, BLOCK_N, BLOCK_K,
                                                               ROWS_FASTEST)
        h_stride_c, h_stride_t = _layout_strides(H_CL, C_in, T)
        res_stride_c, res_stride_t = _layout_strides(RES_CL, C_out, T)
        out_stride_c, out_stride_t = _layout_strides(OUT_CL, C_out, T)
        h_base = h_ptr + batch.to(tl.int64) * C_in * T
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(K_BLOCKS):  # a layer's C_in is fixed: a compile-time trip count
            k = kb * BLOCK_K + offs_k
            k_ok = k < C_in
            a = tl.load(w_ptr + offs_m[:, None] * C_in + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(h_base + k[:, None].to(tl.int64) * h_stride_c + offs_n[None, :].to(tl.int64) * h_stride_t,
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = dot_accumulate(acc, a, b, IEEE, UPCAST)
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
            if HAS_RES_BIAS:
                res += tl.load(res_bias_ptr + offs_m, mask=m_ok, other=0.0).to(tl.float32)[:, None]
            acc += res
        if SNAKE_OUT:
            acc = snake_rows(acc, tl.load(alpha_out_ptr + offs_m, mask=m_ok, other=1.0).to(tl.float32),
                              out_ptr.dtype.element_ty)
        store_with_pair(acc, out_ptr, pair_out_ptr, pair_alpha_ptr, out_offs, mask, offs_m, m_ok, PAIR)

    @triton.jit(do_not_specialize_on_alignment=["T"])
    def _pointwise_conv_tma_kernel(
        w_desc, h_desc, bias_ptr, res_desc, scale_ptr, res_bias_ptr, alpha_out_ptr, out_desc, pair_alpha_ptr, pair_desc,
        C_out, T, n_m_blocks, n_t_blocks,
        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_RES_BIAS: tl.constexpr,
        SNAKE_OUT: tl.constexpr, PAIR: tl.constexpr, H_CL: tl.constexpr, RES_CL: tl.constexpr, OUT_CL: tl.constexpr,
        IEEE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        K_BLOCKS: tl.constexpr, PDL: tl.constexpr, ROWS_FASTEST: tl.constexpr,
    ):
        """The kernel above with every tile moved by TMA through 3-D descriptors ([B, C, T] memory,
        or [B, T, C] where *_CL: such tiles are transposed in shared memory). Out-of-range rows and
        columns load as zeros and are never stored, so no masks but on the per-channel vectors."""
        await_previous_kernel(PDL)
        T = T // 8 * 8  # the same value (the descriptors' 16-byte rows need T % 8 == 0: _tma_tile), known as a multiple of 8
        batch, m_block, t_block = program_tile(tl.program_id(0), n_m_blocks, n_t_blocks, ROWS_FASTEST)
        m0 = m_block * BLOCK_M
        n0 = t_block * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(K_BLOCKS):
            k0 = kb * BLOCK_K
            a = w_desc.load([m0, k0])
            if H_CL:
                b = tl.trans(h_desc.load([batch, n0, k0]).reshape(BLOCK_N, BLOCK_K))
            else:
                b = h_desc.load([batch, k0, n0]).reshape(BLOCK_K, BLOCK_N)
            if IEEE or UPCAST:
                acc = dot_accumulate(acc, a, b, IEEE, UPCAST)
            else:  # accumulated inside the MMA (see _tma_tile)
                acc = tl.dot(a, b, acc)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        m_ok = offs_m < C_out
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_m, mask=m_ok, other=0.0).to(tl.float32)[:, None]
        if HAS_SCALE:
            acc *= tl.load(scale_ptr + batch.to(tl.int64) * T + offs_n, mask=offs_n < T, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            if RES_CL:
                res = tl.trans(res_desc.load([batch, n0, m0]).reshape(BLOCK_N, BLOCK_M)).to(tl.float32)
            else:
                res = res_desc.load([batch, m0, n0]).reshape(BLOCK_M, BLOCK_N).to(tl.float32)
            if HAS_RES_BIAS:
                res += tl.load(res_bias_ptr + offs_m, mask=m_ok, other=0.0).to(tl.float32)[:, None]
            acc += res
        if SNAKE_OUT:
            acc = snake_rows(acc, tl.load(alpha_out_ptr + offs_m, mask=m_ok, other=1.0).to(tl.float32),
                              out_desc.dtype)
        _tma_store(out_desc, acc, batch, m0, n0, OUT_CL, BLOCK_M, BLOCK_N)
        if PAIR:
            pair = snake_rows(acc, tl.load(pair_alpha_ptr + offs_m, mask=m_ok, other=1.0).to(tl.float32),
                               pair_desc.dtype)
            _tma_store(pair_desc, pair, batch, m0, n0, OUT_CL, BLOCK_M, BLOCK_N)

    @triton.jit
    def _layout_strides(CL: tl.constexpr, C, T):
        """(channel stride, time stride) of [B, C, T] memory, or of [B, T, C] memory where CL."""
        if CL:
            return 1, C
        return T, 1

    @triton.jit
    def _tma_store(desc, tile, batch, m0, n0, CL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The fp32 [BLOCK_M, BLOCK_N] tile at (batch, m0, n0) of [B, C, T], in the descriptor's dtype and layout."""
        tile = tile.to(desc.dtype)
        if CL:
            desc.store([batch, n0, m0], tl.trans(tile).reshape(1, BLOCK_N, BLOCK_M))
        else:
            desc.store([batch, m0, n0], tile.reshape(1, BLOCK_M, BLOCK_N))


# --- references ------------------------------------------------------------------------------

def _pointwise_conv_compute(h, weight, bias, residual, scale, input_bias, residual_bias=None) -> Tensor:
    compute = compute_dtype(h)
    hc = h.to(compute)
    if input_bias is not None:
        ib = input_bias.to(compute).reshape(1, -1, 1)
        hc = hc + ib
        residual = None if residual is None else residual.to(compute) + ib
    if residual_bias is not None:
        residual = residual.to(compute) + residual_bias.to(compute).reshape(1, -1, 1)
    y = F.conv1d(hc, weight.to(compute), None if bias is None else bias.to(compute))
    if scale is not None:
        y = y * scale.to(compute)
    if residual is not None:
        y = y + residual.to(compute)
    return y


def pointwise_conv_reference(h: Tensor, weight: Tensor, bias: Tensor | None = None,
                             residual: Tensor | None = None, scale: Tensor | None = None,
                             input_bias: Tensor | None = None, alpha_out: Tensor | None = None, *,
                             residual_bias: Tensor | None = None) -> Tensor:
    """``snake((residual + ib + rb) + scale * (conv1d(h + ib, weight) + bias), alpha_out)`` in
    float32 (float64 for float64 input); ib = input_bias, rb = residual_bias, per channel."""
    y = _pointwise_conv_compute(h, weight, bias, residual, scale, input_bias, residual_bias)
    return maybe_snake(y, alpha_out).to(h.dtype)


def pointwise_conv_pair_reference(h: Tensor, weight: Tensor, bias: Tensor | None = None,
                                  residual: Tensor | None = None, scale: Tensor | None = None,
                                  input_bias: Tensor | None = None, *, alpha: Tensor,
                                  residual_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(y, snake(y, alpha)) for y = :func:`pointwise_conv_reference` (no alpha_out); the snake is
    taken of the unrounded float32 (float64) y."""
    y = _pointwise_conv_compute(h, weight, bias, residual, scale, input_bias, residual_bias)
    return y.to(h.dtype), snake_reference(y, alpha).to(h.dtype)


# --- launcher --------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N) in order of preference; small problems take the first that fills the GPU
_PW_TILES = ((64, 128), (64, 64), (64, 32), (64, 16), (32, 16), (16, 16))


def _pw_config(B: int, C_out: int, C_in: int, T: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Long inputs and batches: 64 x 128 tiles,
    and the whole of C_in <= 128 in one K step (the GEMM is bandwidth-bound there). Streaming
    chunks: the biggest tile that still gives every SM a program, and 128-deep K steps for the
    narrow ones (fewer serial iterations). The NoiseBlock's GEMM, its conv's bias folded, takes the
    same tiles as every other call. Measurements: docs/measurements.md."""
    if interpreter_configs():
        return (max(16, min(128, triton.next_power_of_2(C_out))), max(16, min(1024, triton.next_power_of_2(T))),
                max(16, min(64, triton.next_power_of_2(C_in))), 4, 3)
    cap_m, cap_n = max(16, triton.next_power_of_2(C_out)), max(16, triton.next_power_of_2(T))
    tiles = [(min(m, cap_m), min(n, cap_n)) for m, n in _PW_TILES]
    block_m, block_n = first_filling(tiles, lambda t: B * triton.cdiv(C_out, t[0]) * triton.cdiv(T, t[1]),
                                     wave_programs(device))
    if C_in <= 128:  # the whole reduction in one K step
        block_k = max(16, triton.next_power_of_2(C_in))
    else:
        block_k = 128 if C_in >= 512 and block_n <= 32 else 64
    return block_m, block_n, block_k, 2 if block_m * block_n <= 512 else 4, 3


def _tma_aligned(h: Tensor, w: Tensor, *tensors: Tensor | None) -> bool:
    """Whether TMA can move this call's tiles: 16-byte rows (channels and time steps multiples of
    8) and 16-byte bases."""
    (_, C_in, T), C_out = h.shape, w.shape[0]
    return not (C_out % 8 or C_in % 8 or T % 8 or any(t is not None and t.data_ptr() % 16 for t in (h, w, *tensors)))


def _tma_tile(h: Tensor, w: Tensor, plain: tuple[int, ...],
              *tensors: Tensor | None) -> tuple[int, int, int, int, int] | None:
    """The TMA kernel's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) where it is faster, else None:
    half-precision problems of 256+ output channels large enough for the plain kernel's biggest
    tile (``plain``: the call's :func:`_pw_config`), on Hopper, with 16-byte aligned rows
    (channels and time steps multiples of 8) and bases.
    There it runs 128 x 128 tiles on 8 warps, bitwise the same outputs as the plain kernel and
    faster over a decode's calls; below 256 channels it gained nothing overall, and persistent
    programs looping over tiles were slower (docs/measurements.md). Its K loop accumulates inside
    the MMA (``tl.dot(a, b, acc)``): ``acc + tl.dot(a, b)`` made the calls with [B, T, C] input
    slower than the plain kernel."""
    C_out = w.shape[0]
    if not has_tma(h.device) or h.dtype not in (torch.float16, torch.bfloat16) or C_out < 256:
        return None
    if not _tma_aligned(h, w, *tensors):
        return None
    block_m, block_n, block_k = plain[:3]
    return (128, 128, block_k, 8, 3) if (block_m, block_n) == (64, 128) else None


def _pointwise_conv_triton(h, weight, bias, residual, scale, residual_bias, alpha_out, out,
                           pair_alpha=None, pair_out=None, out_channels_last=False, config=None, rows_fastest=None,
                           tma=None):
    """Writes into out (and pair_out, in out's layout): [B, C_out, T], or [B, T, C_out] when
    ``out_channels_last``. out may be residual itself in the same layout (each element is read
    before it is written, by the same program). h and residual: contiguous or channels-last.
    bias: any float dtype (a folded input bias comes in float32). ``config`` (BLOCK_M, BLOCK_N,
    BLOCK_K, warps, stages) and ``tma`` (the TMA kernel, which needs :func:`_tma_tile`'s alignment)
    override the launch rules."""
    B, C_in, T = h.shape
    C_out = weight.shape[0]
    if out.numel() == 0:
        return
    h = with_layout(h)
    w = weight.reshape(C_out, C_in).contiguous()
    residual = None if residual is None else with_layout(residual)
    h_cl, res_cl = is_channels_last(h), residual is not None and is_channels_last(residual)
    pdl, aligned_t = None, T % 8 == 0
    if config is None:
        def choose():
            chosen, use_tma = _pw_config(B, C_out, C_in, T, h.device), tma
            if use_tma is None:
                tma_config = _tma_tile(h, w, chosen, residual, out, pair_out)
                use_tma, chosen = tma_config is not None, tma_config or chosen
            programs = B * triton.cdiv(C_out, chosen[0]) * triton.cdiv(T, chosen[1])
            return chosen, use_tma, dependent_launch(h.device, programs), aligned_t

        def fits(choice) -> bool:  # TMA and ALIGNED need T % 8 == 0 (TMA 16-byte bases too)
            _, use_tma, _, aligned = choice
            return (not use_tma or _tma_aligned(h, w, residual, out, pair_out)) and (not aligned or aligned_t)

        # the epilogue (bias, residual, snake, pair) does not enter the choice: a layer's launches
        # in a flush may fold a residual bias that the step's do not
        key = ("pointwise", h.device, h.dtype, B, C_out, C_in, tma, h_cl, res_cl, out_channels_last)
        config, tma, pdl, aligned_t = launch_choice(key, choose, fits)
    scale = None if scale is None else scale.contiguous()

    def launch(config):
        block_m, block_n, block_k, warps, stages = config
        n_m, n_t = triton.cdiv(C_out, block_m), triton.cdiv(T, block_n)
        # the output-channel blocks of one time tile run together, so h's columns come from HBM once
        # (docs/measurements.md)
        order = n_m > 1 if rows_fastest is None else rows_fastest
        flat = lambda t: w if t is None else t.reshape(-1)  # noqa: E731 - an unused pointer slot
        flags = dict(HAS_BIAS=bias is not None, HAS_RES=residual is not None, HAS_SCALE=scale is not None,
                     HAS_RES_BIAS=residual_bias is not None, SNAKE_OUT=alpha_out is not None, PAIR=pair_out is not None,
                     IEEE=h.dtype == torch.float32, UPCAST=TRITON_INTERPRET and h.dtype == torch.bfloat16,
                     BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, K_BLOCKS=triton.cdiv(C_in, block_k),
                     ROWS_FASTEST=order, H_CL=h_cl, RES_CL=res_cl, OUT_CL=out_channels_last,
                     num_warps=warps, num_stages=stages, **launch_flags(h.device, B * n_m * n_t, pdl))
        if tma:
            out_desc = _descriptor(out, block_m, block_n, out_channels_last, True)  # out is [B, T, C] when channels-last
            _pointwise_conv_tma_kernel[(B * n_m * n_t,)](
                TensorDescriptor.from_tensor(w, [block_m, block_k]), _descriptor(h, block_k, block_n, h_cl), flat(bias),
                out_desc if residual is None else _descriptor(residual, block_m, block_n, res_cl),
                out if scale is None else scale, flat(residual_bias), flat(alpha_out), out_desc, flat(pair_alpha),
                out_desc if pair_out is None else _descriptor(pair_out, block_m, block_n, out_channels_last, True),
                C_out, T, n_m, n_t, **flags)
            return
        _pointwise_conv_kernel[(B * n_m * n_t,)](
            w, h, flat(bias), out if residual is None else residual, out if scale is None else scale,
            flat(residual_bias), flat(alpha_out), out, flat(pair_alpha), out if pair_out is None else pair_out,
            C_out, C_in, T, n_m, n_t, ALIGNED=aligned_t, **flags)
    launch_fitting(("pointwise_conv_tma" if tma else "pointwise_conv", h.device, h.dtype), config, launch)


def _descriptor(x: Tensor, rows: int, cols: int, channels_last: bool,
                already_transposed: bool = False) -> "TensorDescriptor":
    """A TMA descriptor of [1, rows, cols] tiles over x [B, C, T] in its memory order: [1, cols,
    rows] tiles of the [B, T, C] tensor when ``channels_last`` (x given as that [B, T, C] tensor when
    ``already_transposed``)."""
    if not channels_last:
        return TensorDescriptor.from_tensor(x, [1, rows, cols])
    return TensorDescriptor.from_tensor(x if already_transposed else x.transpose(1, 2), [1, cols, rows])


# --- torch.library op (what torch.compile sees; plain inference calls its body) and the public functions 

def _pointwise_conv(h: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None,
                       scale: Tensor | None, residual_bias: Tensor | None, alpha_out: Tensor | None, out: Tensor,
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
    if kernel_applies(h):
        _pointwise_conv_triton(h, weight, bias, residual, scale, residual_bias, alpha_out, out, pair_alpha, pair_out,
                               out_channels_last)
        return
    if pair_out is None:
        results = [(out, pointwise_conv_reference(h, weight, bias, residual, scale, alpha_out=alpha_out,
                                                  residual_bias=residual_bias))]
    else:
        y, pair = pointwise_conv_pair_reference(h, weight, bias, residual, scale, alpha=pair_alpha,
                                                residual_bias=residual_bias)
        results = [(out, y), (pair_out, pair)]
    for dest, value in results:
        dest.copy_(value.transpose(1, 2) if out_channels_last else value)


_pointwise_conv_op = torch.library.custom_op("snac_fast::pointwise_conv", _pointwise_conv, mutates_args=("out", "pair_out"))


@_pointwise_conv_op.register_fake
def _(h, weight, bias, residual, scale, residual_bias, alpha_out, out, pair_alpha, pair_out, out_channels_last):
    return None


def _check_pointwise(h, weight, bias, residual, scale, input_bias, residual_bias, **alphas: Tensor | None) -> None:
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
    check_per_channel(C_out, bias=bias, residual_bias=residual_bias, **alphas)
    check_per_channel(C_in, input_bias=input_bias)
    if input_bias is not None and residual is not None and C_in != C_out:
        raise ValueError("input_bias with a residual needs C_in == C_out")
    if residual_bias is not None and (residual is None or input_bias is not None):
        raise ValueError("residual_bias needs a residual, and input_bias already adds its bias to the residual")
    check_same_device(h.device, weight, bias, residual, scale, input_bias, residual_bias, *alphas.values())


def fold_input_bias(weight: Tensor, bias: Tensor | None, input_bias: Tensor | None) -> Tensor | None:
    """The GEMM bias that stands for an input bias: ``bias + W @ input_bias`` [C_out], float32
    (float64 for a float64 weight); ``bias`` itself without an input bias. weight: [C_out, C_in, 1]."""
    if input_bias is None:
        return bias
    compute = torch.float64 if weight.dtype == torch.float64 else torch.float32
    folded = weight.reshape(weight.shape[0], -1).to(compute) @ input_bias.to(compute)
    return folded if bias is None else folded + bias.to(compute)


def _gemm_biases(weight, bias, residual, input_bias, residual_bias) -> tuple[Tensor | None, Tensor | None]:
    """(GEMM bias, residual bias) that the kernel takes for an input bias."""
    if input_bias is None:
        return bias, residual_bias
    return fold_input_bias(weight, bias, input_bias), None if residual is None else input_bias


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
                   channels_last: bool = False, residual_bias: Tensor | None = None) -> Tensor:
    """``snake(residual + scale * (W @ h + bias), alpha_out)``: a 1x1 conv with its epilogue fused.

    h: [B, C_in, T]; weight: [C_out, C_in, 1]; bias, alpha_out: [C_out]; residual: [B, C_out, T];
    scale: [B, 1, T]; input_bias: [C_in], added to h and to the residual (needs C_in == C_out when a
    residual is given), as ``bias + W @ input_bias`` (:func:`fold_input_bias`, one small GEMM per
    call) and ``residual_bias``; a caller that keeps the fold passes it as ``bias`` with
    ``residual_bias`` ([C_out], added to the residual alone) instead. h and residual may be contiguous or channels-last
    (:func:`is_channels_last`). Returns [B, C_out, T] in h's dtype: contiguous, or with
    ``channels_last`` laid out [B, T, C_out] in memory (the layout a transposed conv reads fastest).
    out: where to write, in that layout; a contiguous out may be the residual itself (an in-place
    update); never h. Inference only.
    """
    _check_pointwise(h, weight, bias, residual, scale, input_bias, residual_bias, alpha_out=alpha_out)
    out = _output_buffer(out, h, weight.shape[0], "out", channels_last)
    bias, residual_bias = _gemm_biases(weight, bias, residual, input_bias, residual_bias)
    # the op takes the [B, T, C_out] tensor itself: mutated arguments stay plain contiguous tensors
    run = _pointwise_conv_op if through_op(h, weight, bias, residual, scale, residual_bias, alpha_out) else _pointwise_conv
    run(h, weight, bias, residual, scale, residual_bias, alpha_out, out.transpose(1, 2) if channels_last else out,
        None, None, channels_last)
    return out


def pointwise_conv_pair(h: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None,
                        scale: Tensor | None = None, input_bias: Tensor | None = None, *, alpha: Tensor,
                        out: Tensor | None = None, snake_out: Tensor | None = None,
                        residual_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(y, snake(y, alpha)) with y = :func:`pointwise_conv` (no alpha_out), both from one kernel:
    a residual unit's output and the next unit's input snake. out and snake_out: destinations (the
    same rules as :func:`pointwise_conv`'s out; snake_out may be any tensor no longer needed)."""
    _check_pointwise(h, weight, bias, residual, scale, input_bias, residual_bias, alpha=alpha)
    out = _output_buffer(out, h, weight.shape[0], "out")
    snake_out = _output_buffer(snake_out, h, weight.shape[0], "snake_out")
    bias, residual_bias = _gemm_biases(weight, bias, residual, input_bias, residual_bias)
    run = _pointwise_conv_op if through_op(h, weight, bias, residual, scale, residual_bias, alpha) else _pointwise_conv
    run(h, weight, bias, residual, scale, residual_bias, None, out, alpha, snake_out, False)
    return out, snake_out
