"""Where a serving cold start's time goes (GPU): ``codec.warmup(streams=N)`` in this fresh process,
with every compile job and every fork of :mod:`snac_fast.compiling` timed. Prints one JSON line:
the phases; the jobs (count, ``job_cpu_s``: their seconds summed, fork to load; median); the forks
(count, seconds holding the fork lock); the C launchers built (gcc runs in any process: count,
distinct sources, seconds summed); the kernels compiled after the compile pass (``late``: a variant
the pass missed, compiled one by one at capture); this process's minor page faults in the pass and
after it; and the number of workers busy per half second. Run it twice with one
``TRITON_CACHE_DIR``: empty, then warm (warm, the pass is skipped when its manifest finds every
kernel cached: ``compile_s`` is then the check, and the kernels load during the captures). Compare two trees by their ``PYTHONPATH`` (docs/cold_start.md; ``benchmarks/logs/serve_cold_start_late_variants_h100.json``).

    TRITON_CACHE_DIR=$(mktemp -d) python scripts/experiments/warmup_jobs.py --streams 256
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import resource
import tempfile
import threading
import time

START = time.perf_counter()

import torch  # noqa: E402
import triton  # noqa: E402

import snac_fast.compiling as compiling  # noqa: E402
import snac_fast.warmup as snac_warmup  # noqa: E402
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
    builds = _log_launcher_builds()
    codec = FastSNAC.from_pretrained(f"synthetic:{args.model}", device="cuda")
    faults, late = {"load": _minor_faults()}, []
    real_compile_kernels = snac_warmup.compile_kernels

    def counted_compile_kernels(*a, **k):
        try:
            return real_compile_kernels(*a, **k)
        finally:
            faults["compile"] = _minor_faults()
            triton.knobs.runtime.jit_post_compile_hook = lambda *, fn, **_: late.append(fn.name)

    snac_warmup.compile_kernels = counted_compile_kernels
    loaded = time.perf_counter()
    phases = codec.warmup(streams=args.streams)
    faults["end"] = _minor_faults()
    busy = collections.Counter()  # workers busy per half second since the process started
    for start, took, _ in jobs:
        t = start
        while t < start + took:
            b = int(t * 2)
            nxt = min(start + took, (b + 1) / 2)
            busy[b] += (nxt - t) * 2
            t = nxt
    durations = sorted(took for _, took, _ in jobs)
    with open(builds) as f:
        built = [json.loads(line) for line in f]
    print(json.dumps({
        "import_and_load_s": round(loaded - START, 3), "warmup_s": round(time.perf_counter() - loaded, 3),
        **{k: round(v, 3) for k, v in phases.items()},
        "jobs": len(jobs), "job_cpu_s": round(sum(durations), 1),
        "job_median_s": round(durations[len(durations) // 2], 3) if durations else None,
        "forks": len(forks), "fork_s": round(sum(forks), 2),
        "minor_faults_compile": faults["compile"] - faults["load"], "minor_faults_after": faults["end"] - faults["compile"],
        "launcher_builds": len(built), "launcher_sources": len({b["src"] for b in built}),
        "launcher_build_s": round(sum(b["seconds"] for b in built), 1), "late": late,
        "busy_workers_per_half_second": {f"{b / 2:.1f}": round(v, 1) for b, v in sorted(busy.items())},
        "device": torch.cuda.get_device_name(),
    }))


def _minor_faults() -> int:
    """This process's minor page faults so far (a write to a page shared copy-on-write with a
    forked child faults)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _log_launcher_builds() -> str:
    """Make every C launcher build (Triton's gcc run, in this process or a forked child) append
    its source's hash and its seconds to a file; returns the file's path."""
    from triton.runtime import build

    path = tempfile.mkstemp(prefix="launcher-builds-", suffix=".jsonl")[1]
    real_build = build._build

    def logged_build(name, src, *args, **kwargs):
        start = time.perf_counter()  # wall time: children's CPU here would count other reaped processes too
        try:
            return real_build(name, src, *args, **kwargs)
        finally:
            took = time.perf_counter() - start
            with open(src, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()[:12]
            with open(path, "a") as f:
                f.write(json.dumps({"src": digest, "seconds": round(took, 3), "pid": os.getpid()}) + "\n")

    build._build = logged_build
    return path


if __name__ == "__main__":
    main()
