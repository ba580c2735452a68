"""A/B of the 1x1-conv GEMM's launch rule in whole decodes: two float16 codecs per model, one whose
CUDA graphs were captured under the package's rule (``ops/pointwise.py:_pw_config``), one under a
candidate (``wide_input_pw_config`` below: for C_in >= 768, 64-row tiles and 3/4 of a wave at B=1,
128 x T tiles in 64-deep steps once T <= 32; the per-call sweep ``tune_tiles.py --only pw-calls``
found it faster kernel by kernel and nowhere slower). Per call with sync, interleaved rounds with
the order alternating, 10 timed calls a round after an untimed one; medians; and how far the two
outputs differ.

    python scripts/experiments/ab_pw_rule.py --models snac_24khz snac_32khz snac_44khz [--rounds 20]

``--tabulate pw_calls_*.json`` prints, without a GPU, each workload's GEMM time in a
``tune_tiles.py --only pw-calls`` sweep at the package rule, at the candidate, and at each call's best.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/, for bench_common
from bench_common import interleaved_decodes  # noqa: E402

from snac_fast import FastSNAC  # noqa: E402
from snac_fast.ops import pointwise  # noqa: E402
from snac_fast.ops._runtime import first_filling, wave_programs  # noqa: E402
from snac_fast.synthetic import synthetic_model  # noqa: E402


def wide_input_pw_config(B, C_out, C_in, T, device, input_bias=False, wave=None):
    """The candidate rule: the package's, except for wide inputs (C_in >= 768). ``wave``: programs
    per wave when there is no device to ask (``--tabulate``)."""
    cap_m, cap_n = max(16, triton.next_power_of_2(C_out)), max(16, triton.next_power_of_2(T))
    wide = C_in >= 768
    preferred = ((128, 64),) if input_bias and C_in > 128 else ((128, 32),) if wide and T <= 32 else ()
    tiles = [(min(m, cap_m), min(n, cap_n)) for m, n in preferred + pointwise._PW_TILES if m >= 64 or not wide]
    wave = wave or wave_programs(device)
    target = wave * 3 // 4 if wide else wave
    block_m, block_n = first_filling(tiles, lambda t: B * triton.cdiv(C_out, t[0]) * triton.cdiv(T, t[1]), target)
    if C_in <= 128:
        block_k = max(16, triton.next_power_of_2(C_in))
    else:
        block_k = 128 if C_in >= 512 and block_n <= 32 and block_m < 128 else 64
    return block_m, block_n, block_k, 2 if block_m * block_n <= 512 else 4, 3


@contextlib.contextmanager
def rule(config_fn):
    current = pointwise._pw_config
    pointwise._pw_config = config_fn
    try:
        yield
    finally:
        pointwise._pw_config = current


def tabulate(path: str) -> None:
    """Per workload of a pw-calls sweep: µs of GEMMs at the rule, at the candidate, at each call's best."""
    sweep = json.loads(Path(path).read_text())
    wave = 1 << (sweep["environment"]["sm_count"].bit_length() - 1)
    totals: dict[str, list[float]] = {}
    for row in sweep["rows"]:
        input_bias = ast.literal_eval(row["key"])[5]
        candidate = wide_input_pw_config(row["B"], row["C_out"], row["C_in"], row["T"], None, input_bias, wave)
        at_candidate = row["us"]["default" if list(candidate) == row["default"] else str(candidate)]
        for label, n in row["calls"].items():
            total = totals.setdefault(label, [0, 0.0, 0.0, 0.0])
            total[0] += n
            total[1] += n * row["us"]["default"]
            total[2] += n * at_candidate
            total[3] += n * min(row["us"].values())
    print(f"{path}: | workload | GEMM calls | rule | candidate | per-call best | rule above best |")
    for label, (n, at_rule, at_candidate, best) in totals.items():
        print(f"| {label} | {n} | {at_rule:.1f} | {at_candidate:.1f} | {best:.1f} | {100 * (at_rule / best - 1):.1f}% |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["snac_24khz", "snac_32khz", "snac_44khz"])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tabulate", nargs="+", metavar="JSON", help="pw-calls sweeps to tabulate instead")
    args = ap.parse_args()
    if args.tabulate:
        for path in args.tabulate:
            tabulate(path)
        return
    rules = {"current": pointwise._pw_config, "candidate": wide_input_pw_config}
    print(f"{torch.cuda.get_device_name()}, fp16, CUDA graphs, per call with sync, median over {args.rounds} rounds "
          "x 10 calls, ms (GPU: CUDA events around the call)")
    for name in args.models:
        codecs = {mode: FastSNAC(synthetic_model(name), device="cuda") for mode in rules}
        strides = codecs["current"].config["vq_strides"]
        gen = torch.Generator(device="cuda").manual_seed(0)
        work = {f"chunk B={b}": [torch.randint(0, 4096, (b, 4 * strides[0] // s), device="cuda", generator=gen)
                                 for s in strides] for b in (1, 32)}
        for mode, codec in codecs.items():  # the graphs capture the launch configs chosen now
            with rule(rules[mode]):
                for codes in work.values():
                    codec.decode(codes, seed=0)
        medians = interleaved_decodes(codecs, work, args.rounds, calls=10)
        for label in work:
            ms = {m: medians[(m, label)][0] for m in codecs}
            gpu = {m: medians[(m, label)][1] for m in codecs}
            print(f"  {name} decode {label}: per call current {ms['current']:.3f} | candidate {ms['candidate']:.3f} "
                  f"({ms['current'] / ms['candidate']:.3f}x); GPU {gpu['current']:.3f} | {gpu['candidate']:.3f} "
                  f"({gpu['current'] / gpu['candidate']:.3f}x)", flush=True)
        for label, codes in work.items():  # other K steps sum in another order: equal up to rounding
            a, b = (codecs[m].decode(codes, seed=0).double() for m in rules)
            snr = 10 * torch.log10(a.square().sum() / (a - b).square().sum()).item()
            print(f"  {name} decode {label}: candidate vs current: " + ("bitwise equal" if torch.equal(a, b) else
                                                                     f"{snr:.1f} dB SNR"))


if __name__ == "__main__":
    main()
