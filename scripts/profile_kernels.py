"""Where a decode's (or encode's) GPU time goes, kernel by kernel (torch.profiler), and graph replay
vs call latency.

    python scripts/profile_kernels.py --model snac_24khz --frames 4 --batch 1 [--timeline]
    python scripts/profile_kernels.py --model snac_24khz --encode 10 --batch 32
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from kernel_timeline import print_timeline
from snac_fast import FastSNAC
from snac_fast.configs import published_config
from snac_fast.model.synthetic import synthetic_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="snac_24khz")
    ap.add_argument("--frames", type=int, nargs="+", default=[4, 704])
    ap.add_argument("--encode", type=float, nargs="+", default=None,
                    help="profile encodes of these many seconds of audio instead of decodes")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--timeline", action="store_true", help="also list the kernels in launch order")
    args = ap.parse_args()
    cfg = published_config(args.model)
    fast = FastSNAC(synthetic_model(args.model), device="cuda", cuda_graphs=False)
    graphed = FastSNAC(synthetic_model(args.model), device="cuda")
    s = cfg["vq_strides"]
    if args.encode:
        workloads = [(f"encode {sec:g} s", torch.randn(args.batch, 1, round(sec * cfg["sampling_rate"]), device="cuda"))
                     for sec in args.encode]
    else:
        workloads = [(f"frames={n}", [torch.randint(0, 4096, (args.batch, n * s[0] // k), device="cuda") for k in s])
                     for n in args.frames]

    # CPU ops only for the timeline (they name the op behind each kernel); the table stays per kernel
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.timeline else [])

    def run(codec, x):
        return codec.encode(x) if args.encode else codec.decode(x)

    for name, x in workloads:
        for _ in range(3):
            run(fast, x)
            run(graphed, x)
        torch.cuda.synchronize()
        with profile(activities=activities, record_shapes=args.timeline) as prof:
            run(fast, x)
            torch.cuda.synchronize()
        per_kernel = defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k = per_kernel[e.name[:70]]
                k[0] += e.device_time_total / 1e3
                k[1] += 1
        busy = sum(v[0] for v in per_kernel.values())
        n = sum(v[1] for v in per_kernel.values())
        print(f"\n== {args.model} {name} B={args.batch}: {n} kernels, {busy:.3f} ms GPU busy (eager fused) ==")
        for kernel, (ms, cnt) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"  {ms:8.3f} ms {100 * ms / busy:5.1f}%  x{cnt:<4} {kernel}")
        if args.timeline:
            print_timeline(prof, f"{args.model} {name} B={args.batch}, eager")
        replay, call = [], []
        entry = None if args.encode else graphed.graphs._cache[graphed.graphs.key(x)]
        for _ in range(20):
            if entry is not None:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                entry.graph.replay()
                b.record()
                b.synchronize()
                replay.append(a.elapsed_time(b))
            t0 = time.perf_counter()
            run(graphed, x)
            torch.cuda.synchronize()
            call.append((time.perf_counter() - t0) * 1e3)
        alone = f"graph replay alone {statistics.median(replay):.3f} ms; " if replay else ""
        print(f"  {alone}{'encode' if args.encode else 'decode'}() call {statistics.median(call):.3f} ms")


if __name__ == "__main__":
    main()
