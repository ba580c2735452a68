"""What a serving cold start's compiles cost, measured on a CPU (no GPU): the kernel launches of a
stream engine's warm-up (``engine.warmup(max_batch=N)``'s step shapes, recorded under Triton's
interpreter with an H100's launch rules, by ``warmup_variants.py``) are each compiled
for sm_90 (``snac_fast.targets.compile_launch``), and the CPU time of each compile (the compiler
and its ptxas) is summed per kernel. A proxy for the GPU host's compile pass: its 16 workers spend
about this many CPU-seconds (docs/cold_start.md).

    python scripts/experiments/compile_cost.py --streams 256 [--kernel _depthwise] [--workers 2]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor


def record(streams: int) -> list[dict]:
    """The warm-up's distinct launches (``warmup_variants.warmup_launches``, in a child: the
    interpreter must be on before Triton loads, and off here for the compiles)."""
    code = ("import json, sys\n"
            "from dataclasses import asdict\n"
            f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
            "from warmup_variants import warmup_launches\n"
            f"json.dump([asdict(l) for l in warmup_launches('snac_24khz', {streams})[0]], sys.stdout)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    return json.loads(done.stdout)


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _compile(fields: dict) -> tuple[str, float]:
    from snac_fast.targets import _launch_from, compile_launch

    launch = _launch_from(fields)
    start = _cpu_seconds()
    compile_launch(launch, 90)
    return launch.kernel, _cpu_seconds() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--kernel", default="", help="only kernels whose name contains this")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    launches = [l for l in record(args.streams) if args.kernel in l["kernel"]]
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile-cost-")  # every launch compiles
    start = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        costs = list(pool.map(_compile, launches))
    per = collections.defaultdict(list)
    for kernel, seconds in costs:
        per[kernel].append(seconds)
    print(f"{len(costs)} compiles for sm_90: {sum(s for _, s in costs):.1f} CPU-s "
          f"({time.perf_counter() - start:.0f} s on {args.workers} workers)")
    for kernel, seconds in sorted(per.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {kernel:32s} {len(seconds):4d} compiles {sum(seconds):7.1f} CPU-s, {sum(seconds) / len(seconds):.2f} each")


if __name__ == "__main__":
    main()
