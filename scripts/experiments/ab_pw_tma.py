"""A/B of the 1x1-conv GEMM's TMA kernel (``ops/pointwise.py``: ``_pointwise_conv_tma_kernel`` at
the tiles of ``_tma_tile``) against the plain kernel at its own tiles, float16, synthetic weights,
one process:

1. every GEMM call of real eager decodes (recorded), timed alone (a CUDA graph of back-to-back
   calls, median GPU time) in both kernels, with the largest difference between their outputs;
2. whole decodes with CUDA graphs (chunk B=1 and B=32, 5 s, 60 s), one codec captured with the
   TMA rule switched off and one with it: per call with sync and GPU, interleaved rounds, medians.

    python scripts/experiments/ab_pw_tma.py [--models snac_32khz ...] [--rounds 10]

The variants measured before the rule was chosen (the TMA kernel at the plain kernel's tiles,
128 x 256 and 64 x 256 tiles, persistent programs): ``git show 5ca413d:scripts/experiments/ab_pw_tma.py``,
``benchmarks/logs/pw_tma_calls_h100.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/, for bench_common
from ab_noise_fold import codes_for, workloads as decode_workloads  # noqa: E402
from bench_common import interleaved_decodes  # noqa: E402
from tune_tiles import harvest_calls, pw_call_key, timed, workloads  # noqa: E402

from snac_fast import FastSNAC  # noqa: E402
from snac_fast.ops import pointwise  # noqa: E402
from snac_fast.ops.common import is_channels_last  # noqa: E402
from snac_fast.synthetic import synthetic_model  # noqa: E402


@contextlib.contextmanager
def tma_off():
    """The plain kernel for every call (CUDA graphs keep the launches chosen at capture)."""
    rule = pointwise._tma_tile
    pointwise._tma_tile = lambda *args: None
    try:
        yield
    finally:
        pointwise._tma_tile = rule


def per_call(name: str) -> None:
    """Part 1: the calls that take the TMA kernel in eager decodes of every workload."""
    calls, counts = harvest_calls(workloads([name], ["decode"]), pointwise, "_pointwise_conv_triton", pw_call_key)
    # decodes run under inference_mode: clone the recorded tensors into normal ones (strides kept)
    calls = {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in a.items()} for k, a in calls.items()}
    totals = {label: [0.0, 0.0] for label in counts}
    for key, a in calls.items():
        h = a["h"]
        B, C_in, T = h.shape
        C_out = a["weight"].shape[0]
        plain_tile = pointwise._pw_config(B, C_out, C_in, T, h.device)
        tile = pointwise._tma_tile(h, a["weight"].reshape(C_out, C_in), plain_tile, a["residual"], a["out"], a["pair_out"])
        if tile is None:
            continue
        results = {}
        for mode, context in (("plain", tma_off), ("tma", contextlib.nullcontext)):
            with context():
                run = lambda x: pointwise._pointwise_conv_triton(**{**a, "h": x})  # noqa: E731
                run(h)
                results[mode] = (timed(run, h) * 1e3, [t.clone() for t in (a["out"], a["pair_out"]) if t is not None])
        diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(results["plain"][1], results["tma"][1]))
        layout = ("h[B,T,C] " if is_channels_last(h) else "") + ("out[B,T,C] " if a["out_channels_last"] else "")
        flags = "".join(f"{f} " for f, arg in (("pair", "pair_out"), ("res", "residual"), ("scale", "scale")) if a[arg] is not None)
        print(f"  B={B} C_out={C_out} C_in={C_in} T={T} {layout}{flags}: plain {plain_tile} "
              f"{results['plain'][0]:.1f} us | tma {tile} {results['tma'][0]:.1f} us "
              f"({results['plain'][0] / results['tma'][0]:.2f}x) | max diff {diff:.3g}", flush=True)
        for label, c in counts.items():
            totals[label][0] += c[key] * results["plain"][0]
            totals[label][1] += c[key] * results["tma"][0]
    for label, (plain, tma) in totals.items():
        if plain:
            print(f"  {label}, the calls that take TMA: plain {plain:.0f} us | tma {tma:.0f} us ({plain / tma:.3f}x)",
                  flush=True)


def whole_decodes(name: str, rounds: int, gen: torch.Generator) -> None:
    """Part 2: two codecs, graphs captured with the TMA rule off and on."""
    codecs = {mode: FastSNAC(synthetic_model(name), device="cuda") for mode in ("plain", "tma")}
    work = {label: codes_for(codecs["plain"], b, f, gen) for label, (b, f) in decode_workloads(codecs["plain"]).items()}
    for mode, codec in codecs.items():
        with tma_off() if mode == "plain" else contextlib.nullcontext():
            for codes in work.values():
                codec.decode(codes, seed=0)
    medians = interleaved_decodes(codecs, work, rounds)
    for label, codes in work.items():
        (plain_ms, plain_gpu), (tma_ms, tma_gpu) = medians[("plain", label)], medians[("tma", label)]
        a, b = (codecs[m].decode(codes, seed=0) for m in codecs)
        same = "bitwise equal" if torch.equal(a, b) else f"max diff {(a.float() - b.float()).abs().max().item():.3g}"
        print(f"  {name} decode {label}: per call plain {plain_ms:.3f} | tma {tma_ms:.3f} ms ({plain_ms / tma_ms:.3f}x); "
              f"GPU {plain_gpu:.3f} | {tma_gpu:.3f} ms ({plain_gpu / tma_gpu:.3f}x); {same}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["snac_24khz", "snac_32khz", "snac_44khz"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--skip-calls", action="store_true", help="whole decodes only")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, float16, synthetic weights", flush=True)
    for name in args.models:
        if not args.skip_calls:
            per_call(name)
        whole_decodes(name, args.rounds, gen)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
