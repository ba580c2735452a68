"""What cuDNN's per-shape plans cost a warm serving start (GPU): ``codec.warmup(streams=N)`` in this
fresh process with every ``F.conv_transpose2d`` call timed on the host (the transposed convs past
``FusedConvTranspose1d.kernel_max_elements`` run cuDNN; its first call per shape builds a plan), then
the GPU time of the one-frame step graphs of 16, 64 and 256 rows (100 replays, median).
``--triton-only`` sends every transposed conv to the Triton phase GEMM instead. Run it with one
``TRITON_CACHE_DIR`` (once to fill it, then alternating the two forms warm; docs/cold_start.md).

    TRITON_CACHE_DIR=/tmp/tc python scripts/experiments/warmup_cudnn_cost.py [--triton-only]
"""

from __future__ import annotations

import argparse
import collections
import json
import time

START = time.perf_counter()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from snac_fast import FastSNAC  # noqa: E402
from snac_fast.modules import FusedConvTranspose1d  # noqa: E402
from snac_fast.streaming.engine import STEP, StreamEngine  # noqa: E402


def step_gpu_us(engine: StreamEngine, rows: int, replays: int = 100) -> float | None:
    """Median GPU µs of one replay of the warmed one-frame step graph of ``rows`` rows."""
    graph = engine._graphs.get((STEP, rows, 1))
    if graph is None:
        return None
    for _ in range(20):
        graph.launch()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    torch.cuda.synchronize()
    for begun, ended in events:
        begun.record()
        graph.launch()
        ended.record()
    torch.cuda.synchronize()
    return round(1e3 * sorted(b.elapsed_time(e) for b, e in events)[replays // 2], 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="snac_24khz")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--triton-only", action="store_true")
    args = parser.parse_args()
    if args.triton_only:
        FusedConvTranspose1d.kernel_max_elements = 1 << 62
    calls: dict[tuple, list[float]] = collections.defaultdict(list)  # shape key -> host seconds per call
    real = F.conv_transpose2d

    def timed(x, weight, *rest, **kwargs):
        start = time.perf_counter()
        try:
            return real(x, weight, *rest, **kwargs)
        finally:
            calls[(tuple(x.shape), tuple(weight.shape), x.dtype)].append(time.perf_counter() - start)
    F.conv_transpose2d = timed
    codec = FastSNAC.from_pretrained(f"synthetic:{args.model}", device="cuda")
    loaded = time.perf_counter()
    phases = codec.warmup(streams=args.streams)
    warmup_s = time.perf_counter() - loaded
    first = [seconds[0] for seconds in calls.values()]
    print(json.dumps({
        "triton_only": args.triton_only, "import_and_load_s": round(loaded - START, 3), "warmup_s": round(warmup_s, 3),
        **{k: round(v, 3) for k, v in phases.items()},
        "cudnn_shapes": len(calls), "cudnn_first_calls_s": round(sum(first), 3),
        "cudnn_first_call_max_ms": round(1e3 * max(first, default=0.0), 1),
        "cudnn_calls": sum(len(s) for s in calls.values()),
        "cudnn_later_calls_s": round(sum(sum(s[1:]) for s in calls.values()), 3),
        **{f"step_{rows}_gpu_us": step_gpu_us(codec.shared_stream_engine(), rows) for rows in (16, 64, 256)},
        "device": torch.cuda.get_device_name(),
    }))


if __name__ == "__main__":
    main()
