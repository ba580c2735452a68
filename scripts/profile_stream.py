"""Where a stream-engine step's time goes, on the GPU: per-call time with sync, the CUDA graph's
replay alone (GPU time), the host's share, and the kernels of one eager step (torch.profiler),
next to a plain snac-fast decode of one and of four frames at the same batch size.

    python scripts/profile_stream.py --model snac_24khz --streams 1,64 [--out benchmarks/profile.md]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from snac_fast import FastSNAC
from snac_fast.streaming import STEP

from kernel_timeline import print_timeline


def gpu_ms(fn, rounds=20):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return statistics.median(out)


def wall_ms(fn, rounds=20):
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="snac_24khz")
    parser.add_argument("--streams", default="1,64")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--timeline", action="store_true", help="also list the step's kernels in launch order")
    args = parser.parse_args()
    codec = FastSNAC.from_pretrained(f"synthetic:{args.model}", device="cuda")
    strides = codec.config["vq_strides"]
    sizes = [int(s) for s in args.streams.split(",")]
    engine = codec.stream_engine(max(sizes))
    # CPU ops only for the timeline (they name the op behind each kernel); the table stays per kernel
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.timeline else [])
    g = engine.frames_per_group
    gen = torch.Generator().manual_seed(0)
    for S in sizes:
        slots = [engine.open(seed=i) for i in range(S)]
        frames = engine.prefill_frames + 200 * g
        codes = [torch.randint(0, 4096, (S, frames * strides[0] // s), generator=gen) for s in strides]
        f = 0

        def push(k):
            nonlocal f
            engine.advance({s: [c[i, f * strides[0] // x:(f + k) * strides[0] // x] for c, x in zip(codes, strides)]
                            for i, s in enumerate(slots)})
            f += k

        push(engine.prefill_frames)
        for _ in range(3):
            push(g)
        call = wall_ms(lambda: push(g))
        t0 = time.perf_counter()
        for _ in range(20):
            push(g)
        host_async = (time.perf_counter() - t0) / 20 * 1e3  # no sync: host work per call while the GPU keeps up
        torch.cuda.synchronize()
        graph = engine.steps.graphs[("step", 1 << (S - 1).bit_length(), g)]
        replay = gpu_ms(graph.graph.replay)
        window = [torch.randint(0, 4096, (S, 4 * g * strides[0] // s), device="cuda") for s in strides]
        one = [c[:, :c.shape[1] // 4] for c in window]
        with torch.inference_mode():
            for c in (window, one):
                codec.decode(c, seed=1)
            dec4 = gpu_ms(lambda: codec.decode(window, seed=1))
            dec1 = gpu_ms(lambda: codec.decode(one, seed=1))
        print(f"\n## {args.model}, {S} streams, {g} frame(s) per step")
        print(f"call with sync {call:.3f} ms | graph replay GPU {replay:.3f} ms | host per call, unsynced {host_async:.3f} ms "
              f"| snac-fast decode GPU: {g} frame(s) {dec1:.3f} ms, {4 * g} frames {dec4:.3f} ms")
        keys = graph.static_views[0]
        lv = graph.static_views[1:]
        saved = [t.clone() for t in engine.state]
        with torch.inference_mode():
            engine.forward(STEP, keys, lv, g)
            torch.cuda.synchronize()
            with profile(activities=activities, record_shapes=args.timeline) as prof:
                engine.forward(STEP, keys, lv, g)
                torch.cuda.synchronize()
        for t, s in zip(engine.state, saved):
            t.copy_(s)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))
        if args.timeline:
            print_timeline(prof, f"{args.model}, {S} streams, eager step")
        for s in slots:
            engine.close(s)


if __name__ == "__main__":
    main()
