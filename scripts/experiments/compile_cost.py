"""What a serving cold start's compiles cost, measured on a CPU (no GPU): the kernel launches of a
stream engine's warm-up (``engine.warmup(max_batch=N)``'s step shapes, recorded under Triton's
interpreter with an H100's launch rules, as ``warmup_variants.py`` counts them) are each compiled
for sm_90 (``snac_fast.targets.compile_launch``), and the CPU time of each compile (the compiler
and its ptxas) is summed per kernel. A proxy for the GPU host's compile pass: its 16 workers spend
about this many CPU-seconds (docs/serving.md, "Cold start of serving").

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
    """The warm-up's distinct launches (in a child with the interpreter on: it must be set before Triton loads)."""
    code = ("import json, sys, torch\n"
            "from dataclasses import asdict\n"
            "from snac_fast import FastSNAC\n"
            "from snac_fast.ops._runtime import GPUS\n"
            "from snac_fast.streaming.engine import FLUSH, PREFILL, STEP\n"
            "from snac_fast.synthetic import synthetic_model\n"
            "from snac_fast.targets import record_launches\n"
            f"engine = FastSNAC(synthetic_model('snac_24khz'), device='cpu', dtype=torch.float16).stream_engine(max_streams={streams})\n"
            f"buckets = sorted({{min(1 << i, {streams}) for i in range(({streams}).bit_length() + 1)}})\n"
            "shapes = [(k, b, f) for b in buckets for k, f in [(PREFILL, engine.prefill_frames), (FLUSH, 0), (STEP, engine.frames_per_group)]]\n"
            "def run():\n"
            "    for (kind, _, frames), (keys, codes) in engine._warmup_inputs(shapes).items():\n"
            "        engine._forward(kind, torch.from_numpy(keys), [torch.from_numpy(c) for c in codes], frames)\n"
            "json.dump([asdict(l) for l in record_launches(run, GPUS['h100'])], sys.stdout)\n")
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
