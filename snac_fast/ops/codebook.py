"""The residual vector quantizer: codes -> latent (upstream ``ResidualVectorQuantize.from_codes``) in
one Triton kernel, and the encoder's quantization (``forward``) in float32 with its nearest-codeword
search as a Triton kernel; each beside its reference.

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

from snac_fast.ops.common import check_same_device
from snac_fast.ops.device import (
    HAS_TRITON,
    interpreter_configs,
    runs_triton,
    through_op,
)
from snac_fast.ops.launch import first_filling, launch_flags, wave_programs
from snac_fast.ops.snake import KERNEL_DTYPES

MAX_LEVELS = 4

if HAS_TRITON:
    import triton
    import triton.language as tl

    from snac_fast.ops.common import program_tile
    from snac_fast.ops.launch import await_previous_kernel

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
        batch, c_block, t_block = program_tile(tl.program_id(0), n_c_blocks, n_t_blocks)
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

    @triton.jit
    def _nearest_codeword_kernel(e_ptr, table_ptr, table_sq_ptr, best_ptr, best_idx_ptr, N,
                                 CODES_PER_SPLIT: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
                                 BLOCK_C: tl.constexpr):
        """Rows x one slice of the codebook: per row the best score -(|e|^2 - 2 e.c + |c|^2)
        (upstream's float32 formula) and its index, over the slice's codewords; distances of a
        [rows, codewords] tile in registers, never a [N, codebook] matrix. Each lane of the tile
        keeps its own best while the slice is scanned (no reduction per tile); the lanes are
        reduced once at the end, the lowest index winning among equal scores, as in a row scan."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        split = tl.program_id(1)
        r_ok = rows < N
        e_sq = tl.zeros((BLOCK_R,), tl.float32)
        for d in tl.static_range(D):
            e = tl.load(e_ptr + rows * D + d, mask=r_ok, other=0.0)
            e_sq += e * e
        best = tl.full((BLOCK_R, BLOCK_C), float("-inf"), tl.float32)
        best_idx = tl.zeros((BLOCK_R, BLOCK_C), tl.int32)
        for c0 in range(0, CODES_PER_SPLIT, BLOCK_C):
            cols = split * CODES_PER_SPLIT + c0 + tl.arange(0, BLOCK_C)
            dot = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
            for d in tl.static_range(D):
                e = tl.load(e_ptr + rows * D + d, mask=r_ok, other=0.0)
                t = tl.load(table_ptr + cols * D + d)
                dot += e[:, None] * t[None, :]
            score = -((e_sq[:, None] - 2 * dot) + tl.load(table_sq_ptr + cols)[None, :])
            take = score > best  # strictly: a lane keeps its first of equal scores
            best = tl.where(take, score, best)
            best_idx = tl.where(take, cols[None, :], best_idx)
        row_best = tl.max(best, axis=1)
        first = tl.min(tl.where(best == row_best[:, None], best_idx, 2147483647), axis=1)
        out = split.to(tl.int64) * N + rows
        tl.store(best_ptr + out, row_best, mask=r_ok)
        tl.store(best_idx_ptr + out, first.to(tl.int64), mask=r_ok)


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
    block_t = min(triton.next_power_of_2(T), 1024 if interpreter_configs() else 64)
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


def nearest_codeword_reference(encodings: Tensor, table: Tensor) -> Tensor:
    """Upstream ``VectorQuantize.decode_latents``'s search: encodings [N, D] and table [K, D], both
    L2-normalised, in their dtype -> int64 [N], the index of the nearest codeword."""
    dist = encodings.pow(2).sum(1, keepdim=True) - 2 * encodings @ table.t() + table.pow(2).sum(1, keepdim=True).t()
    return (-dist).max(1)[1]


def _nearest_codeword(encodings: Tensor, table: Tensor, table_sq: Tensor | None = None,
                      splits: int | None = None) -> Tensor:
    """table_sq: the table's squared row norms (computed when None). splits: codebook slices across
    programs (default: 1 under the interpreter, else enough for about 2048 (row, slice) pairs: a
    streaming-size encode has ~100 rows)."""
    n_codes = table.shape[0]
    if encodings.dtype != torch.float32 or not runs_triton(encodings) or n_codes % 128:
        return nearest_codeword_reference(encodings, table)
    N, D = encodings.shape
    if N == 0:
        return torch.empty(0, dtype=torch.int64, device=encodings.device)
    encodings, table = encodings.contiguous(), table.contiguous()
    table_sq = table.pow(2).sum(1) if table_sq is None else table_sq.contiguous()
    block_r = 16 if interpreter_configs() else 32
    if splits is None:
        splits = 1 if interpreter_configs() else max(1, min(n_codes // 256, 2048 // N))
    while n_codes % (splits * 128):
        splits -= 1
    best = torch.empty((splits, N), dtype=torch.float32, device=encodings.device)
    # zeros: a compile-only pass (snac_fast.runtime.compiling) skips the kernel, and the gather after it must stay in bounds
    best_idx = torch.zeros((splits, N), dtype=torch.int64, device=encodings.device)
    _nearest_codeword_kernel[(triton.cdiv(N, block_r), splits)](
        encodings, table, table_sq, best, best_idx, N,
        CODES_PER_SPLIT=n_codes // splits, D=D, BLOCK_R=block_r, BLOCK_C=128, num_warps=8)
    if splits == 1:
        return best_idx[0]
    return best_idx.gather(0, best.argmax(0, keepdim=True))[0]


_nearest_codeword_op = torch.library.custom_op("snac_fast::nearest_codeword", _nearest_codeword, mutates_args=())


@_nearest_codeword_op.register_fake
def _(encodings, table, table_sq=None, splits=None):
    return encodings.new_empty(encodings.shape[0], dtype=torch.int64)


def nearest_codeword(encodings: Tensor, table: Tensor, table_sq: Tensor | None = None) -> Tensor:
    """Index of the nearest codeword per row (:func:`nearest_codeword_reference`'s formula); the
    Triton kernel for float32 CUDA (or interpreted) inputs. encodings [N, D], table [K, D],
    table_sq: float32 [K], the table's squared row norms when the caller keeps them."""
    if encodings.dim() != 2 or table.dim() != 2 or encodings.shape[1] != table.shape[1]:
        raise ValueError(f"need encodings [N, D] and a table [K, D], got {tuple(encodings.shape)} and {tuple(table.shape)}")
    check_same_device(encodings.device, table)
    return (_nearest_codeword_op if through_op(encodings, table) else _nearest_codeword)(encodings, table, table_sq)


def quantize(z: Tensor, in_weights: list[Tensor], in_biases: list[Tensor], codebooks: list[Tensor],
             out_weights: list[Tensor], out_biases: list[Tensor], unit_codebooks: list[Tensor] | None,
             unit_norms: list[Tensor] | None, strides: list[int]) -> tuple[Tensor, list[Tensor]]:
    """Upstream ``ResidualVectorQuantize.forward`` (the encoder's quantizer) computed in float32
    whatever z's dtype, with the same operations in the same order: per level, average pooling by
    the stride, the in-projection, L2-normalised nearest codeword, the codeword's out-projection
    repeated by the stride, subtracted from the residual. A float16 model then picks the codeword
    that upstream's float32 model picks (its distances differ by ~1e-3 in float16: near-ties flip).
    The quantized latent is returned as z minus the final residual.

    z: [B, latent_dim, T]; in_weights [D, latent_dim, 1]; codebooks [N, D]; out_weights
    [latent_dim, D, 1]; biases per output channel; unit_codebooks: the codebooks L2-normalised in
    float32, unit_norms: their squared row norms (either None: computed per call); T divisible by
    every stride. Weights not in float32 are cast per call. Returns (the quantized latent in z's
    dtype [B, latent_dim, T], codes: int64 [B, T // stride] per level).
    Torch operations around the :func:`nearest_codeword` kernel (small launches per level; CUDA
    graphs remove their launch cost).
    """
    dtype, z = z.dtype, z.float()
    residual = z.clone()
    B, C = z.shape[:2]
    codes = []
    if unit_codebooks is None:
        unit_codebooks = [F.normalize(table.float()) for table in codebooks]
    if unit_norms is None:  # nearest_codeword computes them
        unit_norms = [None] * len(unit_codebooks)
    for w_in, b_in, table, w_out, b_out, unit_table, unit_sq, stride in zip(
            in_weights, in_biases, codebooks, out_weights, out_biases, unit_codebooks, unit_norms, strides):
        pooled = F.avg_pool1d(residual, stride, stride) if stride > 1 else residual
        # [B, L, D] rows: matmuls, not conv1d (cuDNN may run float32 convs in TF32, matmuls stay float32)
        z_e = F.linear(pooled.transpose(1, 2), w_in.float().squeeze(-1), b_in.float())
        encodings = F.normalize(z_e.reshape(-1, z_e.shape[-1]))
        indices = nearest_codeword(encodings, unit_table, unit_sq).view(B, -1)
        chosen = F.embedding(indices, table.float())
        chosen = z_e + (chosen - z_e)  # upstream's straight-through sum, rounding included
        level = F.linear(chosen, w_out.float().squeeze(-1), b_out.float()).transpose(1, 2)  # [B, C, L]
        residual.view(B, C, -1, stride).sub_(level.unsqueeze(-1))  # the level repeated `stride` times
        codes.append(indices)
    z_q = z - residual  # the sum of the levels (upstream adds them up; equal up to float32 rounding)
    return z_q.to(dtype), codes
