"""Codes -> latent (upstream ``ResidualVectorQuantize.from_codes``) in one Triton kernel, beside its reference.

Upstream runs, per level: an embedding lookup, a transpose, a weight-normed 1x1 conv (codebook_dim
-> latent_dim), a ``repeat_interleave`` by the level's stride, and an add: about five launches per
level. Here one program computes a [channels, time] tile of the sum over levels directly: for each
time step it gathers the level's code (at t // stride), its codebook row (codebook_dim values,
8 in SNAC) and contracts it with the projection, in fp32 registers, rounding once at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from snac_fast.ops._runtime import (HAS_TRITON, TRITON_INTERPRET, first_filling, launch_flags, runs_triton, through_op,
                                    wave_programs)
from snac_fast.ops.conv import check_same_device
from snac_fast.ops.snake import KERNEL_DTYPES

MAX_LEVELS = 4

if HAS_TRITON:
    import triton
    import triton.language as tl

    from snac_fast.ops._runtime import await_previous_kernel
    from snac_fast.ops.conv import _program_tile

    @triton.jit
    def _add_level(acc, codes_ptr, table_ptr, w_ptr, b_ptr, batch, L, offs_c, c_ok, offs_t, t_ok, N,
                   STRIDE: tl.constexpr, D: tl.constexpr):
        idx = tl.load(codes_ptr + batch.to(tl.int64) * L + offs_t // STRIDE, mask=t_ok, other=0).to(tl.int64)
        ok = (idx >= 0) & (idx < N)
        bad = tl.max(tl.where(ok, 0, 1), axis=0)  # masked lanes loaded 0: in range
        idx = tl.where(ok, idx, 0)  # never read out of bounds; the caller learns of it through bad
        for d in tl.static_range(D):
            e = tl.load(table_ptr + idx * D + d, mask=t_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs_c * D + d, mask=c_ok, other=0.0).to(tl.float32)
            acc += w[:, None] * e[None, :]
        return acc + tl.load(b_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)[:, None], bad

    @triton.jit
    def _codes_to_latent_kernel(
        c0, c1, c2, c3, e0, e1, e2, e3, w0, w1, w2, w3, b0, b1, b2, b3, out_ptr, bad_ptr,
        C, T, N, n_c_blocks, n_t_blocks,
        LEVELS: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr,
        D: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, FLAG_BAD: tl.constexpr, PDL: tl.constexpr,
    ):
        await_previous_kernel(PDL)
        batch, c_block, t_block = _program_tile(tl.program_id(0), n_c_blocks, n_t_blocks)
        offs_c = c_block * BLOCK_C + tl.arange(0, BLOCK_C)
        offs_t = t_block * BLOCK_T + tl.arange(0, BLOCK_T)
        c_ok = offs_c < C
        t_ok = offs_t < T
        acc = tl.zeros((BLOCK_C, BLOCK_T), dtype=tl.float32)
        acc, bad = _add_level(acc, c0, e0, w0, b0, batch, T // S0, offs_c, c_ok, offs_t, t_ok, N, S0, D)
        if LEVELS > 1:
            acc, bad1 = _add_level(acc, c1, e1, w1, b1, batch, T // S1, offs_c, c_ok, offs_t, t_ok, N, S1, D)
            bad = tl.maximum(bad, bad1)
        if LEVELS > 2:
            acc, bad2 = _add_level(acc, c2, e2, w2, b2, batch, T // S2, offs_c, c_ok, offs_t, t_ok, N, S2, D)
            bad = tl.maximum(bad, bad2)
        if LEVELS > 3:
            acc, bad3 = _add_level(acc, c3, e3, w3, b3, batch, T // S3, offs_c, c_ok, offs_t, t_ok, N, S3, D)
            bad = tl.maximum(bad, bad3)
        if FLAG_BAD:  # every writer stores the same 1: no atomics needed
            tl.store(bad_ptr, 1, mask=bad > 0)
        out_offs = (batch.to(tl.int64) * C + offs_c.to(tl.int64))[:, None] * T + offs_t[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=c_ok[:, None] & t_ok[None, :])


def codes_to_latent_reference(codes: list[Tensor], codebooks: list[Tensor], weights: list[Tensor],
                              biases: list[Tensor], strides: list[int], dtype: torch.dtype) -> Tensor:
    """Upstream's from_codes in float32 (float64 if dtype is float64), returned in ``dtype``."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    z = 0.0
    for c, table, w, b, s in zip(codes, codebooks, weights, biases, strides):
        e = F.embedding(c.long(), table.to(compute)).transpose(1, 2)
        z = z + F.conv1d(e, w.to(compute), b.to(compute)).repeat_interleave(s, dim=-1)
    return z.to(dtype)


def _codes_to_latent_triton(codes, codebooks, weights, biases, strides, dtype, bad_ids=None):
    B = codes[0].shape[0]
    C, D = weights[0].shape[0], codebooks[0].shape[1]
    T = codes[0].shape[1] * strides[0]
    out = torch.empty((B, C, T), dtype=dtype, device=codes[0].device)
    if out.numel() == 0:
        return out
    pad = lambda xs: [x.contiguous() for x in xs] + [xs[0]] * (MAX_LEVELS - len(xs))  # noqa: E731
    block_t = min(triton.next_power_of_2(T), 1024 if TRITON_INTERPRET else 64)
    block_c = first_filling([(min(triton.next_power_of_2(C), c),) for c in (64, 32, 16)],
                            lambda t: B * triton.cdiv(C, t[0]) * triton.cdiv(T, block_t), wave_programs(out.device))[0]
    n_c, n_t = triton.cdiv(C, block_c), triton.cdiv(T, block_t)
    s = list(strides) + [1] * (MAX_LEVELS - len(strides))
    _codes_to_latent_kernel[(B * n_c * n_t,)](
        *pad(codes), *pad(codebooks), *pad([w.reshape(C, D) for w in weights]), *pad(biases), out,
        out if bad_ids is None else bad_ids, C, T, codebooks[0].shape[0], n_c, n_t,
        LEVELS=len(codes), S0=s[0], S1=s[1], S2=s[2], S3=s[3], D=D, BLOCK_C=block_c, BLOCK_T=block_t,
        FLAG_BAD=bad_ids is not None, num_warps=4, **launch_flags(out.device, B * n_c * n_t),
    )
    return out


def _codes_to_latent(codes, codebooks, weights, biases, strides, dtype, bad_ids):
    if dtype in KERNEL_DTYPES and runs_triton(codes[0]):
        return _codes_to_latent_triton(codes, codebooks, weights, biases, strides, dtype, bad_ids)
    size = codebooks[0].shape[0]
    bad = [(c < 0) | (c >= size) for c in codes]
    if bad_ids is not None and any(b.any() for b in bad):
        bad_ids.fill_(1)
    codes = [c.masked_fill(b, 0) for c, b in zip(codes, bad)]  # as the kernel: row 0 for a bad id
    return codes_to_latent_reference(codes, codebooks, weights, biases, strides, dtype).contiguous()


# two ops, not one with an optional mutated flag: Inductor cannot lower that one
@torch.library.custom_op("snac_fast::codes_to_latent", mutates_args=())
def _codes_to_latent_op(codes: list[Tensor], codebooks: list[Tensor], weights: list[Tensor], biases: list[Tensor],
                        strides: list[int], dtype: torch.dtype) -> Tensor:
    return _codes_to_latent(codes, codebooks, weights, biases, strides, dtype, None)


@torch.library.custom_op("snac_fast::codes_to_latent_flagged", mutates_args=("bad_ids",))
def _codes_to_latent_flagged_op(codes: list[Tensor], codebooks: list[Tensor], weights: list[Tensor],
                                biases: list[Tensor], strides: list[int], dtype: torch.dtype, bad_ids: Tensor) -> Tensor:
    return _codes_to_latent(codes, codebooks, weights, biases, strides, dtype, bad_ids)


@_codes_to_latent_op.register_fake
def _empty_latent(codes, codebooks, weights, biases, strides, dtype, bad_ids=None):
    return codebooks[0].new_empty((codes[0].shape[0], weights[0].shape[0], codes[0].shape[1] * strides[0]), dtype=dtype)


_codes_to_latent_flagged_op.register_fake(_empty_latent)


def codes_to_latent(codes: list[Tensor], codebooks: list[Tensor], weights: list[Tensor], biases: list[Tensor],
                    strides: list[int], dtype: torch.dtype | None = None, bad_ids: Tensor | None = None) -> Tensor:
    """``sum_i repeat_interleave(conv1x1(embedding(codes[i], codebooks[i]), weights[i], biases[i]), strides[i])``.

    codes: integer [B, L_i] per level with L_i * strides[i] equal; codebooks: [N, D]; weights:
    [C, D, 1]; biases: [C]; at most 4 levels. An id outside [0, N) reads row 0 instead (never out
    of bounds) and sets ``bad_ids`` to 1 when given: an int32 [1] flag on the codes' device, or in
    pinned host memory for CUDA codes (the kernel writes it through its mapped address, so a
    CUDA-graph decode needs no copy node to read it after the sync). Returns
    [B, C, L_0 * strides[0]] in ``dtype`` (default: the codebooks' dtype). Inference only.
    """
    n = len(codes)
    if not 1 <= n <= MAX_LEVELS or not len(codebooks) == len(weights) == len(biases) == len(strides) == n:
        raise ValueError(f"need 1 to {MAX_LEVELS} levels with one codebook, weight, bias and stride each")
    if len({c.shape[1] * s for c, s in zip(codes, strides)}) != 1 or len({c.shape[0] for c in codes}) != 1:
        raise ValueError("code levels must share the batch size and the latent length L_i * stride_i")
    if len({tuple(t.shape) for t in codebooks}) != 1 or len({tuple(w.shape) for w in weights}) != 1:
        raise ValueError("all levels need codebooks and projections of one shape")
    if weights[0].shape[1:] != (codebooks[0].shape[1], 1):
        raise ValueError(f"projection weights must be [C, {codebooks[0].shape[1]}, 1], got {tuple(weights[0].shape)}")
    if bad_ids is not None and (bad_ids.dtype != torch.int32 or bad_ids.numel() != 1):
        raise ValueError(f"bad_ids must be an int32 tensor of one element, got {bad_ids.dtype} {tuple(bad_ids.shape)}")
    if bad_ids is not None and bad_ids.device != codes[0].device and not (bad_ids.is_pinned() and codes[0].is_cuda):
        raise ValueError(f"bad_ids must be on {codes[0].device} (or pinned host memory for CUDA codes)")
    check_same_device(codes[0].device, *codes, *codebooks, *weights, *biases)
    args = (list(codes), list(codebooks), list(weights), list(biases), [int(s) for s in strides], dtype or codebooks[0].dtype)
    if not through_op(*codebooks, *weights, *biases):
        return _codes_to_latent(*args, bad_ids)
    return _codes_to_latent_op(*args) if bad_ids is None else _codes_to_latent_flagged_op(*args, bad_ids)
