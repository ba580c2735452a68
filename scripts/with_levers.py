"""Run a script with the GPU-memory levers that are switches, not options, turned on in its process:

    python scripts/with_levers.py --buffers-outside-pool --triton-transposed scripts/profile_memory.py --out r

--buffers-outside-pool: ``snac_fast.streaming.step_graph.BUFFERS_OUTSIDE_POOL`` (each step graph's
output and noise taken outside the graphs' pool); --triton-transposed: every transposed conv through
the Triton phase GEMM (``FusedConvTranspose1d.kernel_max_elements`` unbounded), so that serving
never loads cuDNN's libraries. The allocator's expandable segments are an environment variable
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) and need nothing here. For scripts that do
their work in this process (profile_memory.py, bench_stream.py), not in children they start.
"""

from __future__ import annotations

import argparse
import runpy
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buffers-outside-pool", action="store_true")
    parser.add_argument("--triton-transposed", action="store_true")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.buffers_outside_pool:
        from snac_fast.streaming import step_graph

        step_graph.BUFFERS_OUTSIDE_POOL = True
    if args.triton_transposed:
        from snac_fast.model.modules import FusedConvTranspose1d

        FusedConvTranspose1d.kernel_max_elements = 1 << 62
    sys.argv = [args.script, *args.args]
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
