"""A/B of the one-kernel residual unit (Gluon, ops/residual_unit.py) against the two Triton kernels
it replaces (``SNAC_FAST_GLUON=0``). Float16, synthetic seeded weights, one process:

1. each unit shape of a 24 kHz decode (60 s and a B=32 chunk, blocks 3-4) timed alone, a CUDA graph
   of 20 calls: two kernels against one, with the traffic each moves and its rate;
2. whole decodes with CUDA graphs (chunk B=1 and B=32, 5 s, 60 s) of every model: per call with
   sync and GPU, interleaved rounds, medians, and the SNR between the two;
3. stream-engine steps (24 kHz), 1 and 64 streams: per call with sync and the replay alone.

    python scripts/experiments/ab_gluon_unit.py [--models snac_24khz ...] [--rounds 10]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/, for bench_common
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_noise_fold import codes_for, graph_us, stream_steps, workloads  # noqa: E402
from bench_common import interleaved_decodes  # noqa: E402

from snac_fast import FastSNAC  # noqa: E402
from snac_fast.ops.depthwise import depthwise_conv_snake  # noqa: E402
from snac_fast.ops import pointwise  # noqa: E402
from snac_fast.ops.pointwise import pointwise_conv_pair  # noqa: E402
from snac_fast.ops.residual_unit import residual_unit  # noqa: E402
from snac_fast.ops.snake import snake_reference  # noqa: E402
from snac_fast.synthetic import synthetic_model  # noqa: E402

MODES = {"two kernels": "0", "one kernel": "1"}


class Mode:
    """A codec whose calls run with SNAC_FAST_GLUON set to its mode (graphs capture what runs)."""

    def __init__(self, codec, flag: str) -> None:
        self.codec, self.flag = codec, flag

    def decode(self, codes, seed=0):
        os.environ["SNAC_FAST_GLUON"] = self.flag
        return self.codec.decode(codes, seed=seed)


def unit_kernels() -> None:
    """Part 1: the 24 kHz unit shapes of blocks 3-4 alone."""
    gen = torch.Generator().manual_seed(0)
    for B, C, T in [(1, 128, 719872), (1, 64, 1439744), (1, 96, 1440000), (32, 128, 4096), (32, 64, 8192)]:
        for dilation in (1, 3, 9):
            x = (torch.randn(B, C, T, generator=gen) * 0.5).half().cuda()
            s = snake_reference(x.float(), torch.full((C,), 1.3, device="cuda")).half()
            dw_w = (torch.randn(C, 1, 7, generator=gen) * 0.3).half().cuda()
            pw_w = (torch.randn(C, C, 1, generator=gen) / C**0.5).half().cuda()
            b, a = (torch.randn(C, generator=gen) * 0.1).half().cuda(), torch.rand(C, device="cuda") + 0.5
            out = torch.empty_like(x)
            two = graph_us(lambda: pointwise_conv_pair(depthwise_conv_snake(s, dw_w, b, dilation, a), pw_w, b,
                                                       residual=x, alpha=a, out=out))
            one = graph_us(lambda: residual_unit(x, s, dw_w, b, dilation, a, pw_w, b, pair_alpha=a, out=out))
            cl = torch.empty(B, T, C, dtype=x.dtype, device="cuda").transpose(1, 2)
            two_cl = graph_us(lambda: pointwise.pointwise_conv(depthwise_conv_snake(s, dw_w, b, dilation, a), pw_w, b,
                                                               residual=x, alpha_out=a, out=cl, channels_last=True))
            one_cl = graph_us(lambda: residual_unit(x, s, dw_w, b, dilation, a, pw_w, b, alpha_out=a, out=cl,
                                                    channels_last=True))
            mb = x.numel() * 2 / 1e6
            print(f"  unit B={B} C={C} T={T} d={dilation}: two kernels {two:.1f} us ({6 * mb / two:.2f} TB/s over "
                  f"{6 * mb:.0f} MB) | one kernel {one:.1f} us ({4 * mb / one:.2f} TB/s over {4 * mb:.0f} MB) | "
                  f"{two / one:.2f}x; channels-last snake out: {two_cl:.1f} vs {one_cl:.1f} us ({two_cl / one_cl:.2f}x)",
                  flush=True)


def whole_decodes(name, rounds, gen) -> dict:
    codecs = {m: Mode(FastSNAC(synthetic_model(name), device="cuda"), flag) for m, flag in MODES.items()}
    work = {label: codes_for(codecs["two kernels"].codec, b, f, gen)
            for label, (b, f) in workloads(codecs["two kernels"].codec).items()}
    for codec in codecs.values():
        for codes in work.values():
            codec.decode(codes)
    medians = interleaved_decodes(codecs, work, rounds)
    for label, codes in work.items():
        ms = {m: medians[(m, label)][0] for m in codecs}
        gpu = {m: medians[(m, label)][1] for m in codecs}
        a = codecs["two kernels"].decode(codes).double()
        b = codecs["one kernel"].decode(codes).double()
        snr = 10 * torch.log10(a.square().sum() / (a - b).square().sum()).item()
        print(f"  {name} decode {label}: per call " + " | ".join(f"{m} {v:.3f}" for m, v in ms.items())
              + " ms; GPU " + " | ".join(f"{m} {v:.3f}" for m, v in gpu.items())
              + f" ms ({gpu['two kernels'] / gpu['one kernel']:.3f}x); one vs two kernels {snr:.1f} dB SNR", flush=True)
    return codecs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["snac_24khz", "snac_32khz", "snac_44khz"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--skip-units", action="store_true")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, float16, synthetic weights", flush=True)
    if not args.skip_units:
        unit_kernels()
    for name in args.models:
        codecs = whole_decodes(name, args.rounds, gen)
        if name == "snac_24khz":
            stream_steps({m: wrapped.codec for m, wrapped in codecs.items()}, args.rounds, gen,
                         setup=lambda mode: os.environ.__setitem__("SNAC_FAST_GLUON", MODES[mode]))
        del codecs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
