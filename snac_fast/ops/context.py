"""A streaming stage's input buffer, beside its torch reference.

Each stage of the stream engine (:mod:`snac_fast.streaming`) keeps, per stream, the last H input
samples it has seen (``state[slot]``: [C, H]). A step runs the stage on ``[context | new]`` and
then keeps that buffer's last H samples as the new context. In torch that is a gather, an empty
buffer, two copies and a scatter per stage; here one kernel reads each context row once, writes
the buffer and updates the row in place.
"""

from __future__ import annotations

import torch
from torch import Tensor

from snac_fast.ops.device import HAS_TRITON, interpreter_configs, runs_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _context_step_kernel(state_ptr, slots_ptr, new_ptr, out_ptr, C, H, N, T,
                             s_slot, s_c, n_b, n_c, n_t, o_b, o_c, o_t,
                             BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, TILES: tl.constexpr,
                             STATE_TILES: tl.constexpr, SPLIT: tl.constexpr):
        """SPLIT (H <= BLOCK_T): one program per buffer tile; only tile 0 reads the context, so it
        alone rewrites it. Otherwise one program walks every tile of its rows, then the context."""
        b = tl.program_id(2)
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[:, None]
        slot = tl.load(slots_ptr + b).to(tl.int64)
        row = state_ptr + slot * s_slot + c.to(tl.int64) * s_c  # the context row is contiguous in time
        new = new_ptr + b.to(tl.int64) * n_b + c.to(tl.int64) * n_c
        out = out_ptr + b.to(tl.int64) * o_b + c.to(tl.int64) * o_c
        in_c = c < C
        first = tl.program_id(1) if SPLIT else 0
        for i in range(TILES):  # the buffer: [context | new] (trip counts fixed: few compiled variants)
            t = (first + i) * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
            from_state = t < H
            x = tl.load(row + t, mask=in_c & from_state, other=0.0)
            x += tl.load(new + (t - H) * n_t, mask=in_c & ~from_state & (t < T), other=0.0)
            tl.store(out + t * o_t, x, mask=in_c & (t < T))
        if first == 0:
            tl.debug_barrier()  # every read of the old context is done before the row is overwritten
            for tile in range(STATE_TILES):  # the new context: the buffer's last H samples
                t = tile * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
                src = t + N  # later tiles read only past what earlier tiles wrote
                from_state = src < H
                x = tl.load(row + src, mask=in_c & from_state & (t < H), other=0.0)
                x += tl.load(new + (src - H) * n_t, mask=in_c & ~from_state & (t < H), other=0.0)
                tl.debug_barrier()  # this tile's reads are done before its writes (they overlap when N < BLOCK_T)
                tl.store(row + t, x, mask=in_c & (t < H))


def context_step_reference(state: Tensor, slots: Tensor, new: Tensor, out: Tensor) -> Tensor:
    """Torch reference of :func:`context_step` (same contract)."""
    H = state.shape[2]
    out[:, :, :H] = state.index_select(0, slots)
    out[:, :, H:] = new
    state.index_copy_(0, slots, out[:, :, out.shape[2] - H:])
    return out


# elements of the buffer one program writes
_CONTEXT_TILE = 2048


def _context_tile(C: int, T: int, channels_last: bool) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_C): 64 x 32 channels-last, 128 x 16 otherwise, and fewer time steps but more
    channels per program for buffers shorter than that: a 64-stream step's first stages hold 16-44
    samples per row, and 16 channels per program left each program a few hundred elements between
    two memory round trips (docs/measurements.md)."""
    block_t = min(64 if channels_last else 128, max(16, triton.next_power_of_2(T)))
    return block_t, min(max(16, triton.next_power_of_2(C)), _CONTEXT_TILE // block_t)


def context_step(state: Tensor, slots: Tensor, new: Tensor, channels_last: bool = False) -> Tensor:
    """One step of a stage's context: returns the buffer [B, C, H + N] = [state[slots] | new] and sets
    ``state[slots]`` to the buffer's last H samples, in place.

    state: [S, C, H] contiguous (a row per stream slot); slots: int64 [B] (distinct, except rows that
    only pad a batch); new: [B, C, N], any strides, state's dtype. channels_last: lay the buffer out
    as [B, T, C] in memory (what the transposed conv after it reads fastest)."""
    B, C, N = new.shape
    H = state.shape[2]
    if state.dim() != 3 or state.shape[1] != C or not state.is_contiguous() or new.dtype != state.dtype:
        raise ValueError(f"context_step: state {tuple(state.shape)} {state.dtype} does not fit new "
                         f"{tuple(new.shape)} {new.dtype}")
    out = torch.empty((B, H + N, C), device=new.device, dtype=new.dtype).transpose(1, 2) if channels_last \
        else torch.empty((B, C, H + N), device=new.device, dtype=new.dtype)
    if not runs_triton(new):
        return context_step_reference(state, slots, new, out)
    if interpreter_configs():  # few, large programs: the interpreter's cost is per program and op
        BLOCK_T, BLOCK_C = 256, min(triton.next_power_of_2(C), 256)
    else:
        BLOCK_T, BLOCK_C = _context_tile(C, H + N, channels_last)
    tiles = triton.cdiv(H + N, BLOCK_T)
    split = H <= BLOCK_T  # the old context lies in the first tile: the other tiles can run in parallel
    grid = (triton.cdiv(C, BLOCK_C), tiles if split else 1, B)
    _context_step_kernel[grid](state, slots, new, out, C, H, N, H + N, state.stride(0), state.stride(1),
                               new.stride(0), new.stride(1), new.stride(2), out.stride(0), out.stride(1), out.stride(2),
                               BLOCK_C=BLOCK_C, BLOCK_T=BLOCK_T, TILES=1 if split else tiles,
                               STATE_TILES=triton.cdiv(H, BLOCK_T), SPLIT=split)
    return out
