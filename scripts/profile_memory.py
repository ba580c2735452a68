"""Where a serving engine's GPU memory goes, phase by phase (issue 75).

Builds what `snac-fast serve` builds on one GPU (the shared stream engine of --max-streams slots,
warmed for --max-batch streams) and, after each phase, reads the caching allocator (reserved,
allocated, the phase's peak), the device's used memory (mem_get_info: what nvidia-smi shows, the
CUDA context included) and the allocator's segments by pool (the default pool and each graph pool).
Then it runs real-time-like steps of --streams streams and reads them again.

    python scripts/profile_memory.py --max-streams 1024 --max-batch 256 --streams 256 --out benchmarks
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import gpu_tag  # noqa: E402

from snac_fast import FastSNAC  # noqa: E402
from snac_fast.streaming.shapes import STEP  # noqa: E402

GB = 1e9


def reading(phase: str, device: torch.device, started: float) -> dict:
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    pools: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for segment in torch.cuda.memory_snapshot():
        pool = "default" if tuple(segment.get("segment_pool_id", (0, 0))) == (0, 0) else f"graph{segment['segment_pool_id']}"
        pools[pool][0] += segment["total_size"] / GB
        pools[pool][1] += segment["allocated_size"] / GB
        pools[pool][2] += 1
    stats = torch.cuda.memory_stats(device)
    row = {"phase": phase, "s": round(time.perf_counter() - started, 2),
           "reserved_gb": torch.cuda.memory_reserved(device) / GB,
           "allocated_gb": torch.cuda.memory_allocated(device) / GB,
           "peak_allocated_gb": stats.get("allocated_bytes.all.peak", 0) / GB,
           "peak_reserved_gb": stats.get("reserved_bytes.all.peak", 0) / GB,
           "device_used_gb": (total - free) / GB,
           "pools": {k: {"reserved_gb": v[0], "allocated_gb": v[1], "segments": v[2]} for k, v in pools.items()}}
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "pools"}), flush=True)
    for k, v in sorted(pools.items(), key=lambda kv: -kv[1][0])[:6]:
        print(f"    {k}: reserved {v[0]:.3f} GB, allocated {v[1]:.3f} GB, {v[2]} segments", flush=True)
    torch.cuda.reset_peak_memory_stats(device)
    return row


def timed(run, device: torch.device) -> tuple[float, float]:
    """(ms with sync on the host's clock, GPU ms between CUDA events) of one ``run()``."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    begin.record()
    run()
    end.record()
    torch.cuda.synchronize(device)
    return 1000 * (time.perf_counter() - t0), begin.elapsed_time(end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="synthetic:snac_24khz")
    parser.add_argument("--max-streams", type=int, default=1024)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--streams", type=int, default=256, help="streams stepped after the warm-up")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--empty-cache", action="store_true", help="torch.cuda.empty_cache() after the warm-up")
    parser.add_argument("--rows-per-pass", type=int, default=0,
                        help="the engine's rows_per_pass (serve's --rows-per-pass; 0: whole steps)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--stem", default=None, help="default: memory_24khz_<gpu>")
    args = parser.parse_args()
    device = torch.device("cuda")
    started = time.perf_counter()
    torch.cuda.init()
    rows = [reading("cuda context", device, started)]
    codec = FastSNAC.from_pretrained(args.model, device=device)
    rows.append(reading("codec loaded", device, started))
    engine = codec.shared_stream_engine(max_streams=args.max_streams)
    engine.rows_per_pass = args.rows_per_pass or None
    rows.append(reading(f"engine of {args.max_streams} slots", device, started))
    from snac_fast.runtime.warmup import compile_kernels

    compile_kernels(codec, [(1, 4)], engine=engine, streams=args.max_batch)
    rows.append(reading("compile pass (decode 1x4, steps)", device, started))
    codec.decode([torch.zeros(1, 4 * r, dtype=torch.long, device=device) for r in [1, 2, 4]], seed=0)
    rows.append(reading("decode graph 1x4", device, started))
    graphs = engine.warmup(max_batch=args.max_batch, compiled=True)
    rows.append(reading(f"step graphs ({graphs}) to {args.max_batch} streams", device, started))
    if args.empty_cache:
        torch.cuda.empty_cache()
        rows.append(reading("empty_cache", device, started))
    streams = [engine.open(seed=i) for i in range(args.streams)]
    group = engine.frames_per_group
    rng = np.random.default_rng(0)
    step_ms, gpu_ms = [], []
    for step in range(args.steps):
        pushes = {s: [torch.from_numpy(rng.integers(0, 4096, (1, group * r))) for r in engine.ratios] for s in streams}
        wall, gpu = timed(lambda: engine.advance(pushes), device)
        step_ms.append(wall)
        gpu_ms.append(gpu)
    rows.append(reading(f"{args.steps} steps of {args.streams} streams", device, started))
    # the steps after the first (a prefill): each a call of every stream's one new frame, with sync
    steady = slice(2, None)
    rows[-1].update(step_ms_p50=float(np.median(step_ms[steady])), step_gpu_ms_p50=float(np.median(gpu_ms[steady])))
    print(f"step of {args.streams} streams: {rows[-1]['step_ms_p50']:.3f} ms with sync, "
          f"{rows[-1]['step_gpu_ms_p50']:.3f} ms GPU (median of {len(step_ms[steady])})", flush=True)
    # the 256-stream step's graph alone, replayed back to back: its GPU time without the host's part
    graph = engine.steps.graphs.get((STEP, engine.steps.bucket(args.streams), group))
    if graph is not None:
        replays = [timed(graph.launch, device)[1] for _ in range(60)]
        rows[-1]["step_replay_gpu_ms_p50"] = float(np.median(replays[10:]))
        print(f"the step graph's replay: {rows[-1]['step_replay_gpu_ms_p50']:.3f} ms GPU (median of 50)", flush=True)
    engine.advance({}, finish=streams)
    rows.append(reading("streams finished", device, started))
    torch.cuda.empty_cache()
    rows.append(reading("empty_cache at the end", device, started))
    result = {"device": torch.cuda.get_device_name(device), "date": time.strftime("%Y-%m-%d"),
              "rows_per_pass": args.rows_per_pass or None,
              "command": "python scripts/profile_memory.py " + " ".join(sys.argv[1:]), "rows": rows}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        stem = args.stem or f"memory_24khz_{gpu_tag(result['device'])}"
        (Path(args.out) / f"{stem}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
