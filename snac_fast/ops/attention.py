"""The 32/44 kHz local attention's core, beside its torch reference.

Upstream's LocalMHA projects the normalised input [B, T, C] to q, k and v, splits each into heads
of d channels and windows of n steps, rotates q and k by their position in the window (rotary
embedding), and attends within each window. In torch that core is about twenty launches (the
float32 rotation of q and k, permuted copies, SDPA, the merge of the heads). Here it is one kernel,
a program per (window, head, batch row): it reads q, k and v straight from the QKV projection's
output, rotates q and k in float32 registers and rounds them once to the input dtype (as
:class:`~snac_fast.model.local_attention.HalfLocalMHA`'s torch path does), computes the n x n scores with float32
accumulation, the softmax in float32 with each row's max and sum kept in registers, and writes the
heads already merged, [B, T, C], where the output projection reads them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from snac_fast.ops.device import HAS_TRITON, TRITON_INTERPRET, runs_triton, through_op
from snac_fast.ops.launch import await_previous_kernel, launch_flags

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from snac_fast.ops.common import dot_accumulate

    @triton.jit
    def _local_attention_kernel(qkv_ptr, cos_ptr, sin_ptr, out_ptr, C, s_b, s_t, o_b, o_t, scale,
                                N: tl.constexpr, HALF: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                                PDL: tl.constexpr):
        await_previous_kernel(PDL)
        window, head, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n = tl.arange(0, N)[:, None]
        j = tl.arange(0, HALF)[None, :]
        steps = (window * N + n).to(tl.int64)
        # q, k, v of this head: columns head * d, C + head * d, 2C + head * d; each as its two halves
        q = qkv_ptr + b.to(tl.int64) * s_b + steps * s_t + head * 2 * HALF + j
        k = q + C
        v = q + 2 * C
        cos = tl.load(cos_ptr + n * HALF + j)  # float32 [N, HALF]; upstream's table repeats it for the second half
        sin = tl.load(sin_ptr + n * HALF + j)
        dtype = qkv_ptr.dtype.element_ty
        q1, q2 = tl.load(q).to(tl.float32), tl.load(q + HALF).to(tl.float32)
        k1, k2 = tl.load(k).to(tl.float32), tl.load(k + HALF).to(tl.float32)
        # t * cos + rotate_half(t) * sin, rotate_half(t) = [-t2, t1]; rounded once, like the torch path
        q1, q2 = (q1 * cos - q2 * sin).to(dtype), (q2 * cos + q1 * sin).to(dtype)
        k1, k2 = (k1 * cos - k2 * sin).to(dtype), (k2 * cos + k1 * sin).to(dtype)
        scores = dot_accumulate(tl.zeros((N, N), tl.float32), q1, tl.trans(k1), IEEE, UPCAST)
        scores = dot_accumulate(scores, q2, tl.trans(k2), IEEE, UPCAST) * scale
        top = tl.max(scores, 1)
        p = tl.exp(scores - top[:, None])
        total = tl.sum(p, 1)
        p = p.to(dtype)
        out = out_ptr + b.to(tl.int64) * o_b + steps * o_t + head * 2 * HALF + j
        zero = tl.zeros((N, HALF), tl.float32)
        tl.store(out, (dot_accumulate(zero, p, tl.load(v), IEEE, UPCAST) / total[:, None]).to(dtype))
        tl.store(out + HALF, (dot_accumulate(zero, p, tl.load(v + HALF), IEEE, UPCAST) / total[:, None]).to(dtype))


def _check(qkv: Tensor, heads: int, window: int, cos: Tensor, sin: Tensor) -> None:
    if qkv.dim() != 3 or qkv.shape[2] % (3 * heads):
        raise ValueError(f"qkv must be [B, T, 3 * heads * d] for {heads} heads, got {tuple(qkv.shape)}")
    if qkv.shape[1] % window:
        raise ValueError(f"local attention needs a length divisible by its window {window}, got {qkv.shape[1]}")
    d = qkv.shape[2] // (3 * heads)
    if d % 2 or cos.shape != (window, d // 2) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [{window}, {d // 2}] (half the head size {d}), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if qkv.stride(2) != 1:
        raise ValueError("qkv's channels must be contiguous")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.device != qkv.device or sin.device != qkv.device:
        raise ValueError("cos and sin must be float32 tensors on qkv's device")


def local_attention_reference(qkv: Tensor, heads: int, window: int, cos: Tensor, sin: Tensor) -> Tensor:
    """Torch reference of :func:`local_attention` (same contract): the rotation in float32 rounded
    once, then ``scaled_dot_product_attention`` in qkv's dtype."""
    B, T, C3 = qkv.shape
    C, d = C3 // 3, C3 // (3 * heads)
    q, k, v = qkv.view(B, T // window, window, 3, heads, d).permute(3, 0, 4, 1, 2, 5).unbind(0)  # [B, heads, windows, n, d]
    cos, sin = torch.cat((cos, cos), 1), torch.cat((sin, sin), 1)
    q, k = (_rotate(t, cos, sin).to(qkv.dtype) for t in (q, k))
    shape = (B, heads * (T // window), window, d)
    out = F.scaled_dot_product_attention(q.reshape(shape), k.reshape(shape), v.reshape(shape))
    return out.view(B, heads, T // window, window, d).permute(0, 2, 3, 1, 4).reshape(B, T, C)


def _rotate(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Upstream's apply_rotary_pos_emb (unit scale) in float32: t * cos + rotate_half(t) * sin."""
    t = t.float()
    half = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin


def _kernel_fits(window: int, half: int) -> bool:
    """tl.dot's tiles: the window and half the head size powers of two, at least 16."""
    return all(v >= 16 and v & (v - 1) == 0 for v in (window, half))


def _local_attention(qkv: Tensor, heads: int, window: int, cos: Tensor, sin: Tensor) -> Tensor:
    if qkv.dtype not in KERNEL_DTYPES or not runs_triton(qkv) or not _kernel_fits(window, cos.shape[1]):
        return local_attention_reference(qkv, heads, window, cos, sin)
    B, T, C3 = qkv.shape
    C, half = C3 // 3, C3 // (6 * heads)
    out = qkv.new_empty((B, T, C))
    grid = (T // window, heads, B)
    _local_attention_kernel[grid](qkv, cos.contiguous(), sin.contiguous(), out, C, qkv.stride(0), qkv.stride(1),
                                  out.stride(0), out.stride(1), 1.0 / math.sqrt(2 * half), N=window, HALF=half,
                                  IEEE=qkv.dtype == torch.float32, UPCAST=TRITON_INTERPRET and qkv.dtype == torch.bfloat16,
                                  num_warps=4,
                                  **launch_flags(qkv.device, grid[0] * grid[1] * grid[2]))
    return out


_local_attention_op = torch.library.custom_op("snac_fast::local_attention", _local_attention, mutates_args=())


@_local_attention_op.register_fake
def _(qkv, heads, window, cos, sin):
    return qkv.new_empty((qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3))


def local_attention(qkv: Tensor, heads: int, window: int, cos: Tensor, sin: Tensor) -> Tensor:
    """Windowed multi-head attention with rotary embedding, no mask: LocalMHA between its QKV and
    output projections.

    qkv: [B, T, 3C] (the QKV projection's output: q, k, v one after another, each ``heads`` heads of
    d = C / heads channels; channels contiguous), T a multiple of ``window``; float16, bfloat16 or
    float32. cos, sin: float32 [window, d / 2], the rotary angles of each position in a window
    (upstream repeats them for the second half of d). Returns [B, T, C] in qkv's dtype, heads
    merged as upstream's ``b (w n) (h d)``. Inference only."""
    _check(qkv, heads, window, cos, sin)
    run = _local_attention_op if through_op(qkv) else _local_attention
    return run(qkv, heads, window, cos, sin)
