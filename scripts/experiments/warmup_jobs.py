"""Where a serving cold start's time goes (GPU): ``codec.warmup(streams=N)`` in this fresh process,
with every compile job and every fork of :mod:`snac_fast.compiling` timed. Prints one JSON line:
the phases, the jobs (count, CPU seconds, median), the forks (count, seconds holding the fork lock)
and the number of workers busy per half second. Run it twice with one ``TRITON_CACHE_DIR``: empty,
then warm. Compare two trees by their ``PYTHONPATH`` (docs/serving.md, "Cold start of serving";
``benchmarks/logs/serve_cold_start_variants_h100.json``).

    TRITON_CACHE_DIR=$(mktemp -d) python scripts/experiments/warmup_jobs.py --streams 256
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import threading
import time

START = time.perf_counter()

import torch  # noqa: E402

import snac_fast.compiling as compiling  # noqa: E402
from snac_fast import FastSNAC  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="snac_24khz")
    parser.add_argument("--streams", type=int, default=256)
    args = parser.parse_args()
    forks, jobs = [], []
    real_fork, real_job = os.fork, compiling._compiled_in_child

    def timed_fork():
        start = time.perf_counter()
        pid = real_fork()
        if pid:
            forks.append(time.perf_counter() - start)
        return pid

    def timed_job(compile_fn, *a, **k):
        start = time.perf_counter()
        try:
            return real_job(compile_fn, *a, **k)
        finally:
            jobs.append((start - START, time.perf_counter() - start, threading.get_ident()))

    os.fork, compiling._compiled_in_child = timed_fork, timed_job
    codec = FastSNAC.from_pretrained(f"synthetic:{args.model}", device="cuda")
    loaded = time.perf_counter()
    phases = codec.warmup(streams=args.streams)
    busy = collections.Counter()  # workers busy per half second since the process started
    for start, took, _ in jobs:
        t = start
        while t < start + took:
            b = int(t * 2)
            nxt = min(start + took, (b + 1) / 2)
            busy[b] += (nxt - t) * 2
            t = nxt
    durations = sorted(took for _, took, _ in jobs)
    print(json.dumps({
        "import_and_load_s": round(loaded - START, 3), "warmup_s": round(time.perf_counter() - loaded, 3),
        **{k: round(v, 3) for k, v in phases.items()},
        "jobs": len(jobs), "job_cpu_s": round(sum(durations), 1),
        "job_median_s": round(durations[len(durations) // 2], 3) if durations else None,
        "forks": len(forks), "fork_s": round(sum(forks), 2),
        "busy_workers_per_half_second": {f"{b / 2:.1f}": round(v, 1) for b, v in sorted(busy.items())},
        "device": torch.cuda.get_device_name(),
    }))


if __name__ == "__main__":
    main()
