"""Experiment: the 1x1-conv GEMM (``ops/pointwise.py``) with its tiles moved by the Tensor Memory
Accelerator (Hopper TMA, Triton tensor descriptors) instead of per-thread pointer loads and stores,
optionally persistent (one program per SM slot looping over tiles), against the kernel in the tree.

Every GEMM call of real eager decodes is recorded (``tune_tiles.harvest_calls``), then each distinct
call is timed alone (a CUDA graph of back-to-back calls, median GPU time) at the tree's tile and in
each variant; outputs are compared with the tree's. Also prints how the tree's kernel stores its
tiles (global store widths in its PTX) at the largest call.

    python scripts/ab_pw_tma.py [--models snac_32khz ...] [--labels "decode 60 s" ...]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune_tiles import harvest_calls, pw_call_key, timed, workloads  # noqa: E402

from snac_fast.ops import pointwise as pw_ops  # noqa: E402
from snac_fast.ops.common import _program_tile, _snake_rows, is_channels_last  # noqa: E402


@triton.jit
def _tile_tma(tile, w_desc, h_desc, bias_ptr, res_desc, scale_ptr, res_bias_ptr, alpha_out_ptr, out_desc,
              pair_alpha_ptr, pair_desc, C_out, T, n_m_blocks, n_t_blocks,
              HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_RES_BIAS: tl.constexpr,
              SNAKE_OUT: tl.constexpr, PAIR: tl.constexpr, H_CL: tl.constexpr, RES_CL: tl.constexpr,
              OUT_CL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              K_BLOCKS: tl.constexpr, ROWS_FASTEST: tl.constexpr):
    batch, m_block, t_block = _program_tile(tile, n_m_blocks, n_t_blocks, ROWS_FASTEST)
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
        acc = tl.dot(a, b, acc)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    m_ok = offs_m < C_out
    n_ok = offs_n < T
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_m, mask=m_ok, other=0.0).to(tl.float32)[:, None]
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + batch.to(tl.int64) * T + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        if RES_CL:
            res = tl.trans(res_desc.load([batch, n0, m0]).reshape(BLOCK_N, BLOCK_M))
        else:
            res = res_desc.load([batch, m0, n0]).reshape(BLOCK_M, BLOCK_N)
        res = res.to(tl.float32)
        if HAS_RES_BIAS:
            res += tl.load(res_bias_ptr + offs_m, mask=m_ok, other=0.0).to(tl.float32)[:, None]
        acc += res
    if SNAKE_OUT:
        acc = _snake_rows(acc, tl.load(alpha_out_ptr + offs_m, mask=m_ok, other=1.0).to(tl.float32))
    y = acc.to(out_desc.dtype)
    if OUT_CL:
        out_desc.store([batch, n0, m0], tl.trans(y).reshape(1, BLOCK_N, BLOCK_M))
    else:
        out_desc.store([batch, m0, n0], y.reshape(1, BLOCK_M, BLOCK_N))
    if PAIR:
        pair = _snake_rows(acc, tl.load(pair_alpha_ptr + offs_m, mask=m_ok, other=1.0).to(tl.float32)).to(pair_desc.dtype)
        if OUT_CL:
            pair_desc.store([batch, n0, m0], tl.trans(pair).reshape(1, BLOCK_N, BLOCK_M))
        else:
            pair_desc.store([batch, m0, n0], pair.reshape(1, BLOCK_M, BLOCK_N))


@triton.jit
def _pw_tma_kernel(w_desc, h_desc, bias_ptr, res_desc, scale_ptr, res_bias_ptr, alpha_out_ptr, out_desc,
                   pair_alpha_ptr, pair_desc, C_out, T, n_m_blocks, n_t_blocks, n_tiles,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_RES_BIAS: tl.constexpr,
                   SNAKE_OUT: tl.constexpr, PAIR: tl.constexpr, H_CL: tl.constexpr, RES_CL: tl.constexpr,
                   OUT_CL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   K_BLOCKS: tl.constexpr, ROWS_FASTEST: tl.constexpr, PERSISTENT: tl.constexpr,
                   FLATTEN: tl.constexpr):
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=FLATTEN):
            _tile_tma(tile, w_desc, h_desc, bias_ptr, res_desc, scale_ptr, res_bias_ptr, alpha_out_ptr, out_desc,
                      pair_alpha_ptr, pair_desc, C_out, T, n_m_blocks, n_t_blocks, HAS_BIAS, HAS_RES, HAS_SCALE,
                      HAS_RES_BIAS, SNAKE_OUT, PAIR, H_CL, RES_CL, OUT_CL, BLOCK_M, BLOCK_N, BLOCK_K, K_BLOCKS,
                      ROWS_FASTEST)
    else:
        _tile_tma(tl.program_id(0), w_desc, h_desc, bias_ptr, res_desc, scale_ptr, res_bias_ptr, alpha_out_ptr,
                  out_desc, pair_alpha_ptr, pair_desc, C_out, T, n_m_blocks, n_t_blocks, HAS_BIAS, HAS_RES, HAS_SCALE,
                  HAS_RES_BIAS, SNAKE_OUT, PAIR, H_CL, RES_CL, OUT_CL, BLOCK_M, BLOCK_N, BLOCK_K, K_BLOCKS,
                  ROWS_FASTEST)


def _descriptor(x: torch.Tensor, rows: int, cols: int, channels_last: bool) -> TensorDescriptor:
    """A 3-D descriptor over x [B, C, T] in its memory order: tiles [1, rows, cols] of [B, C, T]
    memory, or [1, cols, rows] of [B, T, C] memory (channels-last)."""
    if channels_last:
        x = x.transpose(1, 2)
        rows, cols = cols, rows
    return TensorDescriptor.from_tensor(x, [1, rows, cols])


def tma_eligible(args) -> bool:
    """16-byte aligned rows for every tensor the descriptors read or write."""
    h, out = args["h"], args["out"]
    B, C_in, T = h.shape
    C_out = args["weight"].shape[0]
    return h.dtype == torch.float16 and T % 8 == 0 and C_in % 8 == 0 and C_out % 8 == 0 and (
        is_channels_last(h) or h.is_contiguous()) and (
        args["residual"] is None or is_channels_last(args["residual"]) or args["residual"].is_contiguous()) and (
        out.is_contiguous())


def pw_tma(args, h, cfg, persistent: int = 0, flatten: bool = False) -> None:
    """The recorded call ``args`` on input h through the TMA kernel at ``cfg`` (BLOCK_M, BLOCK_N,
    BLOCK_K, warps, stages); ``persistent`` programs per SM (0: one program per tile)."""
    w, out, residual, pair_out = args["weight"], args["out"], args["residual"], args["pair_out"]
    B, C_in, T = h.shape
    C_out = w.shape[0]
    block_m, block_n, block_k, warps, stages = cfg
    w2 = w.reshape(C_out, C_in).contiguous()
    out_cl = args["out_channels_last"]
    out_view = out.view(B, T, C_out).transpose(1, 2) if out_cl else out
    pair_view = None if pair_out is None else (pair_out.view(B, T, C_out).transpose(1, 2) if out_cl else pair_out)
    h_cl = is_channels_last(h)
    res_cl = residual is not None and is_channels_last(residual)
    n_m, n_t = triton.cdiv(C_out, block_m), triton.cdiv(T, block_n)
    n_tiles = B * n_m * n_t
    sms = torch.cuda.get_device_properties(h.device).multi_processor_count if h.is_cuda else 2
    grid = min(n_tiles, persistent * sms) if persistent else n_tiles
    flat = lambda t: w2 if t is None else t.reshape(-1)  # noqa: E731
    out_desc = _descriptor(out_view, block_m, block_n, out_cl)
    _pw_tma_kernel[(grid,)](
        TensorDescriptor.from_tensor(w2, [block_m, block_k]), _descriptor(h, block_k, block_n, h_cl), flat(args["bias"]),
        out_desc if residual is None else _descriptor(residual, block_m, block_n, res_cl),
        out if args["scale"] is None else args["scale"].contiguous(), flat(args["residual_bias"]),
        flat(args["alpha_out"]), out_desc, flat(args["pair_alpha"]),
        out_desc if pair_view is None else _descriptor(pair_view, block_m, block_n, out_cl),
        C_out, T, n_m, n_t, n_tiles,
        HAS_BIAS=args["bias"] is not None, HAS_RES=residual is not None, HAS_SCALE=args["scale"] is not None,
        HAS_RES_BIAS=args["residual_bias"] is not None, SNAKE_OUT=args["alpha_out"] is not None,
        PAIR=pair_out is not None, H_CL=h_cl, RES_CL=res_cl, OUT_CL=out_cl,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, K_BLOCKS=triton.cdiv(C_in, block_k),
        ROWS_FASTEST=n_m > 1, PERSISTENT=persistent > 0, FLATTEN=flatten, num_warps=warps, num_stages=stages)


def store_widths(args) -> str:
    """Global store and load instructions by width in the tree's compiled kernel for this call."""
    pw_ops._pointwise_conv_triton(**args)
    counts = collections.Counter()
    for kernel in pw_ops._pointwise_conv_kernel.device_caches[torch.cuda.current_device()][0].values():
        for op in re.findall(r"\b((?:st|ld)\.global(?:\.[a-z0-9]+)*)", kernel.asm["ptx"]):
            counts[op] += 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))


def variants(args) -> dict:
    """name -> (kernel, tile, programs per SM): the tree's kernel and the TMA kernel at the tree's
    tile and at 128 x 128 tiles on 8 warps (not in the tree's candidates, whose tiles stop at 8192
    elements)."""
    B, C_in, T = args["h"].shape
    C_out = args["weight"].shape[0]
    tree = pw_ops._pw_config(B, C_out, C_in, T, args["h"].device)
    out = {"tma": ("tma", tree, 0)}
    if C_out >= 128 and T >= 128:
        for name, cfg in (("128x128 w8", (128, 128, tree[2], 8, 3)), ("128x128 w8 k64 s4", (128, 128, 64, 8, 4)),
                          ("128x256 w8", (128, 256, 64, 8, 3))):
            out[f"tree {name}"] = ("tree", cfg, 0)
            out[f"tma {name}"] = ("tma", cfg, 0)
    if T >= 256:
        out["tma 64x256 w4"] = ("tma", (64, 256, tree[2], 4, 3), 0)
        out["tma 64x256 w8"] = ("tma", (64, 256, tree[2], 8, 3), 0)
    out["tma persistent x2 flatten"] = ("tma", tree, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["snac_24khz", "snac_32khz", "snac_44khz"])
    ap.add_argument("--labels", nargs="+", default=["decode 60 s", "decode chunk B=32", "decode 5 s"])
    args = ap.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    calls, counts = harvest_calls(workloads(args.models, args.labels), pw_ops, "_pointwise_conv_triton", pw_call_key)
    # decodes run under inference_mode: clone the recorded tensors into normal ones (strides kept)
    calls = {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in a.items()} for k, a in calls.items()}
    eligible = {k: a for k, a in calls.items() if tma_eligible(a)}
    print(f"{len(calls)} distinct GEMM calls, {len(eligible)} TMA-eligible", flush=True)
    largest = max(calls.values(), key=lambda a: a["h"].numel())
    print("tree kernel at the largest call:", store_widths(largest), flush=True)
    totals = collections.defaultdict(lambda: collections.defaultdict(float))
    names = ["tree"] + sorted({n for a in eligible.values() for n in variants(a)})
    for key, a in eligible.items():
        B, C_in, T = a["h"].shape
        C_out = a["weight"].shape[0]
        h = a["h"]
        pw_ops._pointwise_conv_triton(**a)
        expect = (a["out"].clone(), None if a["pair_out"] is None else a["pair_out"].clone())
        times = {"tree": timed(lambda x: pw_ops._pointwise_conv_triton(**{**a, "h": x}), h) * 1e3}
        for name, (kernel, cfg, persistent) in variants(a).items():
            if kernel == "tree":
                run = lambda x, cfg=cfg: pw_ops._pointwise_conv_triton(**{**a, "h": x, "config": cfg})  # noqa: E731
            else:
                run = lambda x, cfg=cfg, p=persistent: pw_tma(a, x, cfg, p, p > 0)  # noqa: E731
            try:
                a["out"].fill_(float("nan"))
                run(h)
                err = (a["out"].float() - expect[0].float()).abs().max().item()
                if expect[1] is not None:
                    err = max(err, (a["pair_out"].float() - expect[1].float()).abs().max().item())
                times[name] = timed(run, h) * 1e3
                times[name + " maxdiff"] = err
            except Exception as exc:  # a variant that does not compile or launch at this shape
                times[name] = float("nan")
                print(f"    {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)
        layout = ("h[B,T,C] " if is_channels_last(h) else "") + ("out[B,T,C] " if a["out_channels_last"] else "")
        flags = "pair " if a["pair_out"] is not None else ""
        flags += "res " if a["residual"] is not None else ""
        flags += "scale " if a["scale"] is not None else ""
        print(f"  B={B} C_out={C_out} C_in={C_in} T={T} {layout}{flags}tile {pw_ops._pw_config(B, C_out, C_in, T, h.device)[:3]}: "
              + " | ".join(f"{k} {v:.1f}" if "maxdiff" not in k else f"(diff {v:.3g})" for k, v in times.items()),
              flush=True)
        for label, c in counts.items():
            if key in c:
                for name in names:
                    us = times.get(name, float("nan"))
                    totals[label][name] += c[key] * (times["tree"] if us != us else us)  # the tree's where n/a
                totals[label]["best of all"] += c[key] * min(v for k, v in times.items() if "maxdiff" not in k and v == v)
    for label, per_variant in totals.items():
        base = per_variant["tree"]
        print(f"  {label} (TMA-eligible calls; the tree's time where a variant does not apply): "
              + " | ".join(f"{k} {v:.0f} us ({base / v:.3f}x)" for k, v in per_variant.items()), flush=True)


if __name__ == "__main__":
    main()
