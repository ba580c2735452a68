"""A/B of two versions of the depthwise kernel in one process: an older ``snac_fast/ops/depthwise.py``
(``--against``, e.g. ``git show 6146018:snac_fast/ops/depthwise.py > old_depthwise.py``) loaded beside
the current one. Float16, synthetic seeded weights, CUDA graphs: whole decodes of 24 and 32 kHz
(chunk B=1 and B=32, 5 s, 60 s; interleaved rounds, median GPU time, audio compared bitwise) and
24 kHz stream steps of 1 and 64 streams. Used for the one masked path of the runs
(``benchmarks/logs/dw_one_path_ab_h100.log``); the cold start side is ``warmup_jobs.py``.

    python scripts/experiments/ab_depthwise.py --against old_depthwise.py [--rounds 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/, for bench_common
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_noise_fold import codes_for, load_module, stream_steps, workloads  # noqa: E402
from bench_common import interleaved_decodes  # noqa: E402

import snac_fast.ops.depthwise as depthwise  # noqa: E402
from snac_fast import FastSNAC  # noqa: E402
from snac_fast.synthetic import synthetic_model  # noqa: E402


class Mode:
    """A codec whose calls launch one version's kernel (graphs capture what runs)."""

    def __init__(self, codec, kernel) -> None:
        self.codec, self.kernel = codec, kernel

    def decode(self, codes, seed=0):
        depthwise._depthwise_conv_snake_triton = self.kernel
        return self.codec.decode(codes, seed=seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="an older snac_fast/ops/depthwise.py")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    kernels = {"old": load_module(args.against, "snac_fast.ops.depthwise_against")._depthwise_conv_snake_triton, "new": depthwise._depthwise_conv_snake_triton}
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(torch.cuda.get_device_name(), flush=True)
    for name in ["snac_24khz", "snac_32khz"]:
        codecs = {m: Mode(FastSNAC(synthetic_model(name), device="cuda"), k) for m, k in kernels.items()}
        base = codecs["old"].codec
        work = {label: codes_for(base, b, f, gen) for label, (b, f) in workloads(base).items()}
        for codec in codecs.values():
            for codes in work.values():
                codec.decode(codes)
        medians = interleaved_decodes(codecs, work, args.rounds)
        for label, codes in work.items():
            same = torch.equal(codecs["old"].decode(codes), codecs["new"].decode(codes))
            gpu = {m: medians[(m, label)][1] for m in codecs}
            print(f"  {name} {label}: GPU old {gpu['old']:.4f} ms | new {gpu['new']:.4f} ms "
                  f"({gpu['old'] / gpu['new']:.3f}x); audio equal: {same}", flush=True)
        if name == "snac_24khz":
            stream_steps({m: c.codec for m, c in codecs.items()}, args.rounds, gen,
                         setup=lambda mode: setattr(depthwise, "_depthwise_conv_snake_triton", kernels[mode]))
        del codecs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
