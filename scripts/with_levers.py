"""Run a script with the GPU-memory lever that is a switch, not an option, turned on in its process:

    python scripts/with_levers.py --buffers-outside-pool scripts/profile_memory.py --out r

--buffers-outside-pool: ``snac_fast.streaming.step_graph.BUFFERS_OUTSIDE_POOL`` (each step graph's
output and noise taken outside the graphs' pool). The allocator's expandable segments are an
environment variable (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) and need nothing here.
For scripts that do their work in this process (profile_memory.py, bench_stream.py), not in
children they start. (A third lever, every transposed conv through Triton so that cuDNN never
loads, was measured and dropped: docs/history.md.)
"""

from __future__ import annotations

import argparse
import runpy
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buffers-outside-pool", action="store_true")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.buffers_outside_pool:
        from snac_fast.streaming import step_graph

        step_graph.BUFFERS_OUTSIDE_POOL = True
    sys.argv = [args.script, *args.args]
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
