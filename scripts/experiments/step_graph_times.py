"""GPU time of every step graph a serving warm-up captures (GPU): ``engine.warmup(max_batch=N)`` on a
synthetic 24 kHz model in fp16, then each graph (prefill, one-frame step and flush at every batch
bucket) replayed ``--replays`` times, each timed between CUDA events; prints one JSON line of
medians in ms per ``kind/bucket``. Compare two trees by their ``PYTHONPATH``, in fresh processes
taken in turns (docs/cold_start.md).

    python scripts/experiments/step_graph_times.py --streams 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/, for bench_common
from bench_common import timed_call  # noqa: E402

from snac_fast import FastSNAC  # noqa: E402
from snac_fast.synthetic import synthetic_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    codec = FastSNAC(synthetic_model("snac_24khz"), device="cuda", dtype=torch.float16)
    engine = codec.stream_engine(max_streams=args.streams)
    engine.warmup()
    times = {}
    for (kind, bucket, _), step in sorted(engine._graphs.items(), key=lambda item: (item[0][1], item[0][0])):
        for _ in range(3):
            step.graph.replay()
        times[f"{kind}/{bucket}"] = round(statistics.median(timed_call(step.graph.replay)[1]
                                                            for _ in range(args.replays)), 4)
    print(json.dumps({"label": args.label, "ms": times}), flush=True)


if __name__ == "__main__":
    main()
