"""Sweep launch tiles of the decoder kernels at the 24 kHz decoder's layer shapes; print the best
configs against the current default (what the launch heuristics in snac_fast/ops were set from).

    python scripts/tune_tiles.py --batch 1 32 --frames 4 --only convt pw dw tanh
    python scripts/tune_tiles.py --batch 1 --frames 704 --only pw-order   # 60 s at 24 kHz
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import median_ms  # noqa: E402

from snac_fast.ops import conv_tanh as tanh_ops  # noqa: E402
from snac_fast.ops import depthwise as dw_ops  # noqa: E402
from snac_fast.ops import pointwise as pw_ops  # noqa: E402
from snac_fast.ops import conv_transpose as ct  # noqa: E402

DEV, DT = "cuda", torch.float16


def rnd(*s):
    return torch.randn(*s, device=DEV, dtype=DT)


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def timed(fn, x) -> float:
    """Per-call GPU time (ms) of fn(x); small problems run many calls in one graph, since a single
    small kernel would time the graph launch."""
    calls = max(1, min(20, (1 << 23) // x.numel()))
    return median_ms(fn, [(x,)] * calls, replays=10)


def sweep(what, default_fn, fn, cfgs, x):
    default = timed(default_fn, x)
    results = []
    for cfg in cfgs:
        try:
            results.append((timed(lambda x: fn(x, cfg), x), cfg))
        except triton.runtime.errors.OutOfResources:  # too much shared memory for this tile
            pass
    results.sort()
    best = ", ".join(f"{t * 1e3:.1f}us {c}" for t, c in results[:4])
    print(f"  {what}: default {default * 1e3:.1f}us | best {best}", flush=True)


def pw_into(h, w, b, res, alpha, cfg):
    """A residual unit's tail when there is a residual (the pair: output and next snake), else a plain 1x1 conv."""
    out = torch.empty((h.shape[0], w.shape[0], h.shape[2]), device=DEV, dtype=DT)
    pair = None if res is None else torch.empty_like(out)
    pw_ops._pointwise_conv_triton(h, w, b, res, None, None, None, out, alpha if pair is not None else None, pair, config=cfg)
    return out


def sweep_pw(shapes, batches):
    cfgs = [(bm, bn, bk, w, 3) for bm, bn in itertools.product((16, 32, 64, 128), (16, 32, 64, 128, 256))
            for bk in (32, 64, 128) for w in ((2,) if bm * bn <= 512 else (4, 8) if bm * bn >= 8192 else (4,))]
    for C_out, C_in, T in shapes:
        w, b, a = rnd(C_out, C_in, 1) / C_in**0.5, rnd(C_out), torch.rand(C_out, device=DEV) + 0.5
        for B in batches:
            h = rnd(B, C_in, T)
            res = rnd(B, C_out, T) if C_in == C_out else None
            call = lambda h, cfg=None: pw_into(h, w, b, res, a, cfg)  # noqa: E731
            sweep(f"pw C_out={C_out} C_in={C_in} T={T} B={B}", call, call,
                  [c for c in cfgs if c[2] <= C_in and c[1] <= max(16, pow2(T))], h)


def pw_order(shapes, batches):
    """The GEMM's program order at its default tiles: output-channel blocks fastest (the programs of
    one time tile together, sharing its input columns through L2) against time tiles fastest."""
    for C, T in shapes:
        w, b, a = rnd(C, C, 1) / C**0.5, rnd(C), torch.rand(C, device=DEV) + 0.5
        for B in batches:
            h, res = rnd(B, C, T), rnd(B, C, T)
            out, pair = torch.empty_like(h), torch.empty_like(h)
            cfg = pw_ops._pw_config(B, C, C, T, h.device)
            times = {order: timed(lambda h, rows=rows: pw_ops._pointwise_conv_triton(
                h, w, b, res, None, None, None, out, a, pair, config=cfg, rows_fastest=rows), h) * 1e3
                for order, rows in (("time tiles fastest", False), ("channel blocks fastest", True))}
            print(f"  pw order C={C} T={T} B={B} {cfg}: " + ", ".join(f"{k} {v:.1f}us" for k, v in times.items()), flush=True)


def dw_configs(T: int, rows_max: int) -> list[tuple[int, int, int, int]]:
    """(ROWS, BLOCK_T, num_warps, RUN): per-tap loads (RUN 0), or runs of RUN aligned chunks of 8
    for T % 8 == 0, at 8 to 32 outputs per thread."""
    cfgs = set()
    for elems, bt, w, run in itertools.product((256, 512, 1024, 2048, 4096), (16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
                                               (1, 2, 4, 8), (0, 1, 2)):
        per_thread = elems // (32 * w)
        fits = per_thread >= 4 if run == 0 else T % 8 == 0 and bt % (8 * run) == 0 and 8 * run <= per_thread <= 32
        if bt <= min(elems, max(16, pow2(T))) and elems // bt <= rows_max and fits:
            cfgs.add((elems // bt, bt, w, run))
    return sorted(cfgs)


def sweep_dw(shapes, batches):
    for C, T in shapes:
        wt, b, a = rnd(C, 1, 7) * 0.3, rnd(C), torch.rand(C, device=DEV) + 0.5
        for B, dilation in itertools.product(batches, (1, 3, 9)):
            x = rnd(B, C, T)
            call = lambda x, cfg=None: dw_ops._depthwise_conv_snake_triton(x, wt, b, dilation, a, cfg)  # noqa: E731
            sweep(f"dw C={C} T={T} B={B} dilation={dilation}", call, call, dw_configs(T, pow2(B * C)), x)


def channels_last(x):
    """x [B, C, T] laid out [B, T, C]: what the decoder feeds its transposed convs."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def cudnn_channels_last(x, w, s):
    """cuDNN's transposed conv on channels-last memory, no bias (FusedConvTranspose1d's cuDNN path)."""
    pad, opad = ct.upsampling_padding(s)
    w4 = w.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    return lambda x: F.conv_transpose2d(x.unsqueeze(2), w4, None, (1, s), (0, pad), (0, opad))


def sweep_convt(shapes, batches):
    for C_in, C_out, s, T_in in shapes:
        P = pow2(s)
        wt = rnd(C_in, C_out, 2 * s) / C_in**0.5
        bias = rnd(C_out)
        packed = ct.pack_phase_weight(wt, s)
        split = ct.splits_phases(s)
        cfgs = [(rows // P, bj, bk, w, st) for rows in (16, 32, 64, 128, 256) for bj in (16, 32, 64, 128)
                for bk in (32, 64, 128) for w in (4, 8) for st in (3,)
                if rows >= P and (not split or rows >= 32) and rows * bj <= 32768]
        for B in batches:
            x = channels_last(rnd(B, C_in, T_in))
            cudnn = timed(cudnn_channels_last(x, wt, s), x)
            call = lambda x, cfg=None: ct._conv_transpose_triton(x, packed, bias, s, cfg)  # noqa: E731
            sweep(f"convT C_in={C_in} C_out={C_out} s={s} T_in={T_in} B={B} (cuDNN no bias {cudnn * 1e3:.1f}us)",
                  call, call, [c for c in cfgs if c[1] <= max(16, pow2(T_in))], x)


def convt_paths(shapes, batches):
    """The Triton kernel with its default tiles against cuDNN (no bias), both on channels-last input
    (cuDNN also on [B, C, T] memory, where it adds layout transforms): where each path wins."""
    for C_in, C_out, s, T_in in shapes:
        wt = rnd(C_in, C_out, 2 * s) / C_in**0.5
        packed = ct.pack_phase_weight(wt, s)
        pad, opad = ct.upsampling_padding(s)
        for B in batches:
            x = rnd(B, C_in, T_in)
            x_cl = channels_last(x)
            ours = timed(lambda x: ct._conv_transpose_triton(x, packed, None, s), x_cl)
            cudnn = timed(cudnn_channels_last(x_cl, wt, s), x_cl)
            cudnn_ncl = timed(lambda x: F.conv_transpose1d(x, wt, None, s, pad, opad), x)
            print(f"  convT C_in={C_in} s={s} T_in={T_in} B={B} out {B * C_out * T_in * s / 1e6:.2f} M: "
                  f"triton {ours * 1e3:.1f}us, cuDNN channels-last {cudnn * 1e3:.1f}us, [B, C, T] {cudnn_ncl * 1e3:.1f}us",
                  flush=True)


def sweep_tanh(lengths, batches):
    cfgs = [(bc, bt, w) for bc in (16, 32, 64) for bt in (32, 64, 128, 256, 512) for w in (2, 4, 8)
            if 2048 <= bc * bt <= 8192]
    w, b = rnd(1, 64, 7) / 8, rnd(1)
    for T in lengths:
        for B in batches:
            x = rnd(B, 64, T)
            call = lambda x, cfg=None: tanh_ops._conv_tanh_triton(x, w, b, cfg)  # noqa: E731
            taps = ", ".join(f"{timed(lambda x: tanh_ops._conv_tanh_by_taps(x, w, b, bt), x) * 1e3:.1f}us ({bt})"
                             for bt in (64, 128, 256, 512))
            sweep(f"conv_tanh C=64 T={T} B={B} (tap GEMM by BLOCK_T: {taps})", call, call, cfgs, x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--only", nargs="+", default=["pw", "convt", "dw", "tanh"])
    args = ap.parse_args()
    T0 = 4 * args.frames
    t0 = time.time()
    for part in args.only:
        if part == "convt":
            sweep_convt([(1024, 512, 8, T0), (512, 256, 8, 8 * T0), (256, 128, 4, 64 * T0), (128, 64, 2, 256 * T0)],
                        args.batch)
        elif part == "pw":
            sweep_pw([(1024, 768, T0), (512, 512, 8 * T0), (256, 256, 64 * T0), (128, 128, 256 * T0),
                      (64, 64, 512 * T0)], args.batch)
        elif part == "pw-order":  # the 24 kHz units' widths, then the 32/44 kHz ones (T0 latent steps)
            pw_order([(512, 8 * T0), (256, 64 * T0), (128, 256 * T0), (64, 512 * T0),
                      (768, 8 * T0), (384, 64 * T0), (192, 192 * T0), (96, 384 * T0)], args.batch)
        elif part == "dw":
            sweep_dw([(768, T0), (512, 8 * T0), (256, 64 * T0), (128, 256 * T0), (64, 512 * T0)], args.batch)
        elif part == "convt-paths":
            convt_paths([(1024, 512, 8, T0), (512, 256, 8, 8 * T0), (256, 128, 4, 64 * T0), (128, 64, 2, 256 * T0)],
                        args.batch)
        elif part == "tanh":
            sweep_tanh([512 * T0], args.batch)
        print(f"[{part} done at {time.time() - t0:.0f}s]", flush=True)


if __name__ == "__main__":
    main()
