"""Position-keyed Gaussian noise for the NoiseBlocks, beside its torch reference.

Upstream draws ``randn(B, 1, T)`` afresh in every NoiseBlock call, so the noise a sample gets
depends on how the decode was cut up. Here each value is a pure function of
(seed, row, NoiseBlock index, absolute sample index): Philox-4x32-10 keyed by the 64-bit seed, with
the counter (position low 32 bits, position high 32 bits, row, block), then Box-Muller on the first
two words (Triton's ``uint_to_uniform_float`` and ``pair_uniform_to_normal``). A decode of a prefix,
a stream cut into any pushes, or one row of a batch then get exactly the same noise as the whole
decode. Position of buffer sample t in row b: ``frames[b] * frame_samples + start + t``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from snac_fast.ops.device import HAS_TRITON, runs_triton

_MASK32 = 0xFFFFFFFF
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_UNIFORM_SCALE = 4.6566127342e-10  # Triton's: the largest int32 times it stays below 1.0

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["frame_samples", "start", "T", "block"])  # one compiled variant
    def _keyed_normal_kernel(out_ptr, seeds_ptr, rows_ptr, frames_ptr, frame_samples, start, T, block,
                             BLOCK_T: tl.constexpr):
        b = tl.program_id(1)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        seed = tl.load(seeds_ptr + b)
        row = tl.load(rows_ptr + b)
        pos = tl.load(frames_ptr + b) * frame_samples + start + t.to(tl.int64)
        c0 = (pos & 0xFFFFFFFF).to(tl.uint32)
        c1 = ((pos >> 32) & 0xFFFFFFFF).to(tl.uint32)
        c2 = (row & 0xFFFFFFFF).to(tl.uint32) + c0 * 0
        c3 = (c0 * 0 + block).to(tl.uint32)
        r0, r1, _, _ = tl.philox(seed, c0, c1, c2, c3)
        normal, _ = tl.pair_uniform_to_normal(tl.uint_to_uniform_float(r0), tl.uint_to_uniform_float(r1))
        tl.store(out_ptr + b.to(tl.int64) * T + t, normal.to(out_ptr.dtype.element_ty), mask=t < T)


def _mul_hi_lo(a: Tensor, b: int) -> tuple[Tensor, Tensor]:
    """(high, low) 32-bit words of a * b for a: int64 holding uint32 values, b: a uint32 constant,
    in int64 arithmetic without overflow (b split into 16-bit halves)."""
    high_part, low_part = a * (b >> 16), a * (b & 0xFFFF)  # each < 2**48
    mid = ((high_part & 0xFFFF) << 16) + low_part
    return (high_part >> 16) + (mid >> 32), mid & _MASK32


def philox_reference(seed: Tensor, c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, rounds: int = 10) -> tuple[Tensor, ...]:
    """Philox-4x32 in int64 torch arithmetic (uint32 values), the same as Triton's ``tl.philox``.
    seed: int64 (its two 32-bit halves are the key); counters: int64 tensors of uint32 values."""
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(rounds):
        hi_b, lo_b = _mul_hi_lo(c2, _PHILOX_ROUND_B)
        hi_a, lo_a = _mul_hi_lo(c0, _PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _MASK32, (k1 + _PHILOX_KEY_B) & _MASK32
    return c0, c1, c2, c3


def _uniform(word: Tensor) -> Tensor:
    signed = torch.where(word >= 1 << 31, word - (1 << 32), word)  # the word as int32
    signed = torch.where(signed < 0, -signed - 1, signed)
    return signed.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


def keyed_normal_reference(seeds: Tensor, rows: Tensor, frames: Tensor, frame_samples: int, start: int, length: int,
                           block: int) -> Tensor:
    """float32 [B, 1, length]: the noise :func:`keyed_normal` draws, computed with torch ops."""
    pos = frames.to(torch.int64)[:, None] * frame_samples + start + torch.arange(length, device=seeds.device)
    return keyed_normal_at(seeds, rows, pos, torch.full((length,), block, dtype=torch.int64, device=seeds.device)).unsqueeze(1)


def keyed_normal_at(seeds: Tensor, rows: Tensor, positions: Tensor, blocks: Tensor) -> Tensor:
    """float32 [B, N]: the keyed noise of row b at ``positions[b, i]`` for NoiseBlock ``blocks[i]``,
    with torch ops: one pass draws the samples of several blocks (a CPU step's cost is per op).
    seeds, rows: int64 [B]; positions: int64 [B, N]; blocks: int64 [N]."""
    c0, c1 = positions & _MASK32, (positions >> 32) & _MASK32
    c2 = (rows.to(torch.int64)[:, None] & _MASK32).expand_as(positions)
    c3 = blocks.expand_as(positions)
    r0, r1, _, _ = philox_reference(seeds.to(torch.int64)[:, None], c0, c1, c2, c3)
    u1 = torch.clamp(_uniform(r0), min=1.0e-7)
    theta = 6.283185307179586 * _uniform(r1)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(theta)


def keyed_normal(seeds: Tensor, rows: Tensor, frames: Tensor, frame_samples: int, start: int, length: int,
                 block: int, dtype: torch.dtype = torch.float32, out: Tensor | None = None) -> Tensor:
    """Standard normal noise [B, 1, length] in ``dtype`` on the seeds' device, a pure function of
    (seeds[b], rows[b], block, position): position of sample t in row b is
    ``frames[b] * frame_samples + start + t`` (may be negative). seeds, rows, frames: int64 [B] on
    one device (device tensors, so a CUDA graph can replay it with new values). block: the
    NoiseBlock's index (0..2**32). out: an optional contiguous destination of that shape."""
    if not (seeds.shape == rows.shape == frames.shape and seeds.dim() == 1):
        raise ValueError(f"seeds, rows and frames must be [B] tensors of one size, got "
                         f"{tuple(seeds.shape)}, {tuple(rows.shape)}, {tuple(frames.shape)}")
    if any(t.dtype != torch.int64 or t.device != seeds.device for t in (seeds, rows, frames)):
        raise ValueError("seeds, rows and frames must be int64 tensors on one device")
    if length < 0 or not 0 <= block <= _MASK32:
        raise ValueError(f"length must be >= 0 and block in [0, 2**32), got {length}, {block}")
    B = seeds.shape[0]
    if out is None:
        out = torch.empty((B, 1, length), device=seeds.device, dtype=dtype)
    elif tuple(out.shape) != (B, 1, length) or not out.is_contiguous() or out.device != seeds.device:
        raise ValueError(f"out must be a contiguous tensor {(B, 1, length)} on {seeds.device}")
    if out.numel() == 0:
        return out
    if runs_triton(seeds) and out.dtype in (torch.float16, torch.bfloat16, torch.float32):
        block_t = 1024
        _keyed_normal_kernel[(triton.cdiv(length, block_t), B)](
            out, seeds, rows, frames, int(frame_samples), int(start), length, int(block), BLOCK_T=block_t, num_warps=4)
        return out
    out.copy_(keyed_normal_reference(seeds, rows, frames, frame_samples, start, length, block))
    return out
