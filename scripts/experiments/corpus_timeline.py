"""Timeline of the local corpus engine (GPU): for each launch round of ``encode_dataset``, when the
launching thread began and how long it took, and when the GPU started and finished that round's
work (CUDA events around the launches): where the GPU waits, and for what.

    python scripts/experiments/corpus_timeline.py --files 6000 --out benchmarks/logs/encode_corpus_timeline_h100.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_encode import write_corpus  # noqa: E402

from snac_fast import FastSNAC, datasets  # noqa: E402
from snac_fast.datasets import encode as engine  # noqa: E402
from snac_fast.synthetic import synthetic_model  # noqa: E402


def timed_run(codec, folder: Path, out: Path) -> dict:
    """One run with every round's launches timed on the host and on the GPU (seconds from the start)."""
    rounds, launch = [], engine.launch_batches

    def timed_launch(codec_, batches, graphs=None):
        t0, e0, e1 = time.perf_counter(), torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        launched = launch(codec_, batches, graphs)
        e1.record()
        rounds.append((t0, time.perf_counter(), e0, e1, len(batches), sum(len(b.rows) for b in batches),
                       graphs.captures if graphs is not None else 0))
        return launched

    engine.launch_batches = timed_launch
    try:
        start = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        t_start = time.perf_counter()
        summary = datasets.encode_dataset(folder, out, codec, progress=False)
        torch.cuda.synchronize()
    finally:
        engine.launch_batches = launch
    rows, gpu_free, idle = [], 0.0, 0.0
    for t0, t1, e0, e1, batches, clips, captures in rounds:
        gpu_start, gpu_end = start.elapsed_time(e0) / 1e3, start.elapsed_time(e1) / 1e3
        waited = max(0.0, gpu_start - gpu_free) if batches else 0.0
        idle += waited
        gpu_free = max(gpu_free, gpu_end)
        rows.append({"host_start_s": t0 - t_start, "host_ms": (t1 - t0) * 1e3, "gpu_start_s": gpu_start,
                     "gpu_end_s": gpu_end, "gpu_idle_before_ms": waited * 1e3, "batches": batches, "clips": clips,
                     "captures_so_far": captures})
    return {"wall_s": summary["wall_seconds"], "first_launch_s": rows[0]["host_start_s"] if rows else None,
            "gpu_idle_s": idle, "launching_s": sum(r["host_ms"] for r in rows) / 1e3, "rounds": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=6000)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("corpus_timeline.json"))
    args = ap.parse_args()
    codec = FastSNAC(synthetic_model("snac_24khz"), device="cuda", dtype=torch.float16, source="synthetic:snac_24khz")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "corpus"
        write_corpus(folder, args.files)
        datasets.encode_dataset(folder, Path(tmp) / "warm", codec, progress=False)  # compiles: not timed
        runs = [timed_run(codec, folder, Path(tmp) / f"out{k}") for k in range(args.runs)]
    for run in runs:
        print({k: round(v, 3) for k, v in run.items() if k != "rounds"})
    args.out.write_text(json.dumps({"files": args.files, "device": torch.cuda.get_device_name(), "runs": runs},
                                   indent=1) + "\n")


if __name__ == "__main__":
    main()
