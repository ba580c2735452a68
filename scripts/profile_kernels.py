"""Where a decode's GPU time goes, kernel by kernel (torch.profiler), and graph replay vs call latency.

    python scripts/profile_kernels.py --model snac_24khz --frames 4 --batch 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from snac_fast import FastSNAC
from snac_fast.configs import published_config
from snac_fast.testing import synthetic_model


def tune_depthwise() -> None:
    import sys
    from pathlib import Path

    import snac_fast.ops.conv as conv

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_common import median_ms

    for C, T in [(64, 1441792), (128, 720896), (256, 180224), (512, 22528)]:
        x = torch.randn(1, C, T, device="cuda", dtype=torch.float16)
        w = torch.randn(C, 1, 7, device="cuda", dtype=torch.float16)
        b = torch.randn(C, device="cuda", dtype=torch.float16)
        a = torch.rand(C, device="cuda") + 0.5
        floor = median_ms(lambda x: x.clone(), [(x,)])
        for d in (1, 9):
            res = []
            for block_t in (256, 512, 1024, 2048, 4096):
                for warps in (2, 4, 8):
                    for rows in (1, 2, 4):
                        cfg = (rows, block_t, warps)
                        res.append((median_ms(lambda x: conv._depthwise_conv_snake_triton(x, w, b, d, a, cfg), [(x,)]), cfg))
            res.sort()
            now = median_ms(lambda x: conv._depthwise_conv_snake_triton(x, w, b, d, a), [(x,)])
            print(f"C={C} T={T} d={d}: copy {floor * 1e3:.0f} us, current {now * 1e3:.0f} us, best "
                  + ", ".join(f"{t * 1e3:.0f} us {c}" for t, c in res[:3]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="snac_24khz")
    ap.add_argument("--frames", type=int, nargs="+", default=[4, 704])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--tune-depthwise", action="store_true", help="sweep the depthwise kernel's launch configs")
    args = ap.parse_args()
    if args.tune_depthwise:
        tune_depthwise()
        return
    cfg = published_config(args.model)
    fast = FastSNAC(synthetic_model(args.model), device="cuda", cuda_graphs=False)
    graphed = FastSNAC(synthetic_model(args.model), device="cuda")
    for frames in args.frames:
        s = cfg["vq_strides"]
        codes = [torch.randint(0, 4096, (args.batch, frames * s[0] // k), device="cuda") for k in s]
        for _ in range(3):
            fast.decode(codes)
            graphed.decode(codes)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fast.decode(codes)
            torch.cuda.synchronize()
        per_kernel = defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k = per_kernel[e.name[:70]]
                k[0] += e.device_time_total / 1e3
                k[1] += 1
        busy = sum(v[0] for v in per_kernel.values())
        n = sum(v[1] for v in per_kernel.values())
        print(f"\n== {args.model} frames={frames} B={args.batch}: {n} kernels, {busy:.3f} ms GPU busy (eager fused) ==")
        for name, (ms, cnt) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"  {ms:8.3f} ms {100 * ms / busy:5.1f}%  x{cnt:<4} {name}")
        entry = graphed.graphs._cache[graphed.graphs.key(codes)]
        replay, call = [], []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            entry.graph.replay()
            b.record()
            b.synchronize()
            replay.append(a.elapsed_time(b))
            t0 = time.perf_counter()
            graphed.decode(codes)
            torch.cuda.synchronize()
            call.append((time.perf_counter() - t0) * 1e3)
        print(f"  graph replay alone {statistics.median(replay):.3f} ms; decode() call {statistics.median(call):.3f} ms")


if __name__ == "__main__":
    main()
