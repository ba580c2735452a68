"""Whole-decode benchmark (GPU): snac-fast against upstream snac eager and under torch.compile.

    python scripts/bench_decode.py --model snac_24khz --out benchmarks/decode_24khz_h100

Every peer is built afresh for each workload, so each torch.compile peer is compiled for that one
shape (``dynamic=False``): a compile fed several shapes turns dynamic and slows down. Two compile
peers, both mode="reduce-overhead": upstream under fp16 autocast, and upstream with its weight norm
folded and the model cast to fp16 (its local attention kept in fp32, where upstream fails in half).
The modes of a workload are timed in interleaved rounds over rotated code sets; each call is timed
on the host (wall clock with a synchronize: what a caller waits) and on the GPU (CUDA events around
the call). Fidelity: SNR against upstream float32 (TF32 off), same codes and CPU-drawn noise.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import environment, markdown_table, timed_call, write_results  # noqa: E402

from snac_fast import FastSNAC  # noqa: E402
from snac_fast.configs import published_config  # noqa: E402
from snac_fast.fidelity import decode_with_noise, true_float32  # noqa: E402
from snac_fast.metrics import snr_db  # noqa: E402
from snac_fast.model.surgery import fold_weight_norm, to_device_dtype  # noqa: E402
from snac_fast.model.synthetic import synthetic_model  # noqa: E402

CUDA = torch.device("cuda")
N_SETS = 3


def workloads(name: str) -> list[tuple[str, int, int]]:
    """(label, coarse frames, batch): streaming chunk at B=1 and B=32, 5 s and 60 s at B=1."""
    cfg = published_config(name)
    frames_per_s = cfg["sampling_rate"] / (cfg["vq_strides"][0] * _hop(cfg))
    step = 4 if cfg["attn_window_size"] else 1  # 32/44 kHz attention windows need multiples of 4
    at = lambda s: max(step, round(s * frames_per_s / step) * step)  # noqa: E731
    return [("stream n=4 B=1", 4, 1), ("stream n=4 B=32", 4, 32), (f"5 s n={at(5)} B=1", at(5), 1),
            (f"60 s n={at(60)} B=1", at(60), 1)]


def _hop(cfg) -> int:
    hop = 1
    for r in cfg["encoder_rates"]:
        hop *= r
    return hop


def codes_for(cfg, frames: int, batch: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    s = cfg["vq_strides"]
    return [torch.randint(0, cfg["codebook_size"], (batch, frames * s[0] // k), generator=gen).to(CUDA) for k in s]


def upstream(name, dtype, fold=False):
    model = synthetic_model(name)
    if fold:
        fold_weight_norm(model)
    to_device_dtype(model, CUDA, dtype)
    return model


def compiled_upstream(name, folded_half: bool):
    """torch.compile reduce-overhead with static shapes: under fp16 autocast, or folded and cast to fp16."""
    model = upstream(name, torch.float16 if folded_half else torch.float32, fold=folded_half)
    decode = torch.compile(model.decode, mode="reduce-overhead", dynamic=False)
    if folded_half:
        return decode

    def run(codes):
        with torch.autocast("cuda", dtype=torch.float16):
            return decode(codes)

    return run


def fast_model(name, **kw):
    return FastSNAC(synthetic_model(name), device=CUDA, dtype=torch.float16, **kw)


EAGER, AUTOCAST, FOLDED, FAST = ("upstream eager fp32", "compile r-o fp16 autocast", "compile r-o fp16 folded",
                                 "snac-fast fp16")
MODES = {
    EAGER: lambda name: upstream(name, torch.float32).decode,
    AUTOCAST: lambda name: compiled_upstream(name, folded_half=False),
    FOLDED: lambda name: compiled_upstream(name, folded_half=True),
    FAST: lambda name: fast_model(name).decode,
}


def bench_workload(name: str, frames: int, batch: int, rounds: int, failed: dict, label: str) -> dict:
    """Build every mode for this one shape, then time them in interleaved rounds."""
    cfg = published_config(name)
    sets = [codes_for(cfg, frames, batch, seed) for seed in range(N_SETS)]
    built, first = {}, {}
    torch._dynamo.reset()  # nothing compiled for another shape survives: each compile sees one shape
    for mode, build in MODES.items():
        t0 = time.perf_counter()
        try:
            fn = build(name)
            with torch.inference_mode():
                for codes in sets * 2:  # compile / capture, then warm every set
                    fn(codes)
            torch.cuda.synchronize()
        except Exception as err:  # report it and go on: the other modes' figures still count
            failed[f"{mode} / {label}"] = f"{type(err).__name__}: {err}"[:2000]
            traceback.print_exc()
            continue
        built[mode], first[mode] = fn, time.perf_counter() - t0
    per_round = 4 if frames > 100 else 12
    walls = {m: [] for m in built}
    gpus = {m: [] for m in built}
    for r in range(rounds):
        order = list(built) if r % 2 == 0 else list(reversed(built))
        for mode in order:
            for i in range(per_round):
                wall, gpu = timed_call(built[mode], sets[(r + i) % N_SETS])
                walls[mode].append(wall)
                gpus[mode].append(gpu)
    audio_s = frames * cfg["vq_strides"][0] * _hop(cfg) * batch / cfg["sampling_rate"]
    out = {}
    for mode in built:
        ms = statistics.median(walls[mode])
        out[mode] = {"median_ms": ms, "gpu_median_ms": statistics.median(gpus[mode]), "min_ms": min(walls[mode]),
                     "rtf": audio_s / (ms / 1e3), "calls": len(walls[mode]), "build_and_warmup_s": first[mode]}
        print(f"{mode:<28} {label:<18} {ms:9.3f} ms  GPU {out[mode]['gpu_median_ms']:9.3f} ms", flush=True)
    del built
    gc.collect()
    torch.cuda.empty_cache()
    return out


def fidelity(name: str, frames: int) -> dict:
    """SNR vs upstream float32 (TF32 off), same codes and CPU-drawn noise: plain upstream fp16 (its
    attention in fp32) and snac-fast fp16."""
    cfg = published_config(name)
    codes = codes_for(cfg, frames, 2, seed=99)
    ref_model = upstream(name, torch.float32)
    with true_float32():
        ref = decode_with_noise(ref_model, codes, 0, CUDA)
    del ref_model
    result = {"plain upstream fp16": snr_db(ref, decode_with_noise(upstream(name, torch.float16), codes, 0, CUDA))}
    fast = fast_model(name)
    result[FAST] = snr_db(ref, fast.decode(codes, generator=torch.Generator().manual_seed(0)).float().cpu())
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="snac_24khz")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/decode"))
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds per workload")
    ap.add_argument("--workloads", nargs="*", help="only these workload labels' first words (stream, 5, 60)")
    args = ap.parse_args()
    loads = workloads(args.model)
    if args.workloads:
        loads = [w for w in loads if any(w[0].startswith(p) for p in args.workloads)]
    results, failed = {}, {}
    for label, frames, batch in loads:
        results[label] = bench_workload(args.model, frames, batch, args.rounds, failed, label)
    fid_frames = next(f for lbl, f, b in workloads(args.model) if lbl.startswith("5 s"))
    fid = fidelity(args.model, fid_frames)
    print("fidelity (SNR dB vs upstream fp32):", {k: round(v, 2) for k, v in fid.items()})
    env = environment()
    header = ["workload", "mode", "per call ms", "GPU ms", "× realtime", "vs eager fp32", "vs best compile", "build + warm-up s"]
    rows = []
    for label, by_mode in results.items():
        compiled = [by_mode[m]["median_ms"] for m in (AUTOCAST, FOLDED) if m in by_mode]
        for mode, r in by_mode.items():
            vs_eager = f"{by_mode[EAGER]['median_ms'] / r['median_ms']:.2f}x" if EAGER in by_mode else "-"
            vs_compile = f"{min(compiled) / r['median_ms']:.2f}x" if compiled else "-"
            rows.append([label, mode, f"{r['median_ms']:.3f}", f"{r['gpu_median_ms']:.3f}", f"{r['rtf']:.0f}", vs_eager,
                         vs_compile, f"{r['build_and_warmup_s']:.1f}"])
    md = (f"# Decode benchmark: {args.model}\n\n{env['device']}, {env['date']}, torch {env['torch']}, triton {env['triton']}. "
          f"`{'SNAC_FAST_GPU_LIMITS=' + env['gpu_limits'] + ' ' if env['gpu_limits'] else ''}"
          f"python scripts/bench_decode.py --model {args.model} --rounds {args.rounds}"
          + (f" --workloads {' '.join(args.workloads)}" if args.workloads else "") + "`. Every mode built afresh per "
          "workload (torch.compile peers: reduce-overhead, `dynamic=False`, one shape each); modes timed in "
          f"{args.rounds} interleaved rounds over {N_SETS} rotated code sets; per call = wall clock with a synchronize, "
          "GPU = CUDA events around the call; medians. 'vs best compile': the faster compile peer's per-call time "
          "over this mode's. Synthetic seeded weights.\n\n"
          + markdown_table(header, rows)
          + "\nFidelity, SNR against upstream float32 (TF32 off), same codes and noise, B=2, "
          + f"{fid_frames} coarse frames: " + ", ".join(f"{k} {v:.2f} dB" for k, v in fid.items()) + "\n")
    if failed:
        md += "\nFailed: " + "; ".join(f"{k}: {v.splitlines()[0]}" for k, v in failed.items()) + "\n"
    write_results(args.out.parent, args.out.name, {"environment": env, "model": args.model, "results": results,
                                                   "fidelity_snr_db": fid, "failed": failed}, md)
    print(md)


if __name__ == "__main__":
    main()
