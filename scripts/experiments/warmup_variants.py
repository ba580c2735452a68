"""Kernel variants a stream engine's warm-up compiles, counted on a CPU (no GPU): every step shape
``engine.warmup(max_batch=N)`` captures (prefill, one-group step and flush at each batch bucket) is
run through Triton's interpreter with an H100's launch rules, recording each distinct launch
(:func:`snac_fast.targets.record_launches`): kernel, constexprs, warps and stages, and the int and
pointer arguments Triton specializes as divisible by 16. Each distinct launch is one compile of an
empty-cache cold start.

    TRITON_INTERPRET=1 python scripts/experiments/warmup_variants.py --streams 256
"""

from __future__ import annotations

import argparse
import collections
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

import torch  # noqa: E402

from snac_fast import FastSNAC  # noqa: E402
from snac_fast.ops._runtime import GPUS  # noqa: E402
from snac_fast.streaming.engine import FLUSH, PREFILL, STEP, warmup_buckets  # noqa: E402
from snac_fast.synthetic import synthetic_model  # noqa: E402
from snac_fast.targets import record_launches  # noqa: E402


def warmup_launches(model: str, streams: int, gpu: str = "h100", buckets: list[int] | None = None):
    """(the distinct launches, the number of step graphs) of a ``streams``-stream engine's warm-up on
    ``model`` with ``gpu``'s launch rules; ``buckets``: the batch buckets warmed (default: the
    engine's). Needs ``TRITON_INTERPRET=1`` before Triton is imported."""
    codec = FastSNAC(synthetic_model(model), device="cpu", dtype=torch.float16)
    engine = codec.stream_engine(max_streams=streams)
    buckets = sorted(buckets or warmup_buckets(streams))
    shapes = [(kind, b, k) for b in buckets
              for kind, k in [(STEP, engine.frames_per_group), (PREFILL, engine.prefill_frames), (FLUSH, 0)]]

    def run() -> None:  # what engine.warmup's shapes-only pass launches (its inputs, on the CPU)
        for (kind, _, frames), (keys, codes) in engine._warmup_inputs(shapes).items():
            engine._forward(kind, torch.from_numpy(keys), [torch.from_numpy(c) for c in codes], frames)

    return record_launches(run, GPUS[gpu]), len(shapes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="snac_24khz")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    parser.add_argument("--buckets", default=None, help="batch buckets to warm, e.g. 1,16,64,256 (default: the engine's)")
    args = parser.parse_args()
    buckets = [int(b) for b in args.buckets.split(",")] if args.buckets else None
    launches, graphs = warmup_launches(args.model, args.streams, args.gpu, buckets)
    print(f"{args.model}, {args.streams} streams, {graphs // 3} buckets x 3 step kinds = {graphs} graphs: "
          f"{len(launches)} distinct launches")
    for kernel, n in collections.Counter(launch.kernel for launch in launches).most_common():
        print(f"  {n:4d} {kernel}")
    unaligned = {(l.kernel, l.signature, l.constexprs, l.num_warps, l.num_stages) for l in launches}
    print(f"without the divisible-by-16 specializations: {len(unaligned)}")


if __name__ == "__main__":
    main()
