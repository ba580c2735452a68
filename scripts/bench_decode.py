"""Whole-decode benchmark (GPU): snac-fast's modes against upstream snac and torch.compile, one run.

    python scripts/bench_decode.py --model snac_24khz --out benchmarks/decode_24khz_h200
    python scripts/bench_decode.py --model snac_32khz --skip max-autotune --out ...

Latency is wall clock per call with a device synchronize (what a caller waits: host overhead, launch
gaps and GPU time), median over rotated input sets after warm-up. Fidelity: SNR of each mode
against upstream float32 (TF32 off) on the same codes and the same CPU-drawn noise.
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
from bench_common import environment, markdown_table, write_results  # noqa: E402

from snac_fast import FastSNAC  # noqa: E402
from snac_fast.configs import published_config  # noqa: E402
from snac_fast.fidelity import _true_float32, decode_with_noise  # noqa: E402
from snac_fast.metrics import snr_db  # noqa: E402
from snac_fast.surgery import to_device_dtype  # noqa: E402
from snac_fast.testing import synthetic_model  # noqa: E402

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


def time_calls(fn, code_sets, warmup: int, reps: int) -> list[float]:
    """Per-call latency (ms) with a synchronize, after warm-up."""
    for i in range(warmup):
        fn(code_sets[i % len(code_sets)])
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(code_sets[i % len(code_sets)])
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


class Mode:
    """A way to decode: ``build()`` returns a callable codes -> audio (compiling, if any, on first call)."""

    def __init__(self, label, build):
        self.label, self.build = label, build


def upstream(name, dtype, fold=False):
    model = synthetic_model(name)
    if fold:
        from snac_fast.surgery import fold_weight_norm

        fold_weight_norm(model)
    to_device_dtype(model, CUDA, dtype)
    return model


def compiled_upstream(name, mode):
    model = upstream(name, torch.float32)
    decode = torch.compile(model.decode, mode=mode)

    def run(codes):
        with torch.autocast("cuda", dtype=torch.float16):
            return decode(codes)

    return run


def fast_model(name, **kw):
    return FastSNAC(synthetic_model(name), device=CUDA, dtype=torch.float16, **kw)


def modes(name: str, skip: set[str]) -> list[Mode]:
    out = [
        Mode("upstream eager fp32", lambda: upstream(name, torch.float32).decode),
        Mode("upstream eager fp16", lambda: upstream(name, torch.float16).decode),
        Mode("compile reduce-overhead fp16", lambda: compiled_upstream(name, "reduce-overhead")),
        Mode("compile max-autotune fp16", lambda: compiled_upstream(name, "max-autotune-no-cudagraphs")),
        Mode("snac-fast eager fp16", lambda: fast_model(name, cuda_graphs=False).decode),
        Mode("snac-fast graphs fp16", lambda: fast_model(name).decode),
        Mode("snac-fast + compile reduce-overhead", lambda: torch.compile(fast_model(name, cuda_graphs=False).model.decode,
                                                                          mode="reduce-overhead")),
    ]
    return [m for m in out if not any(s in m.label for s in skip)]


def run_inference(fn, codes):
    with torch.inference_mode():
        return fn(codes)


def fidelity(name: str, frames: int) -> dict:
    """SNR vs upstream float32 (TF32 off), same codes and CPU-drawn noise: plain upstream fp16 and
    snac-fast eager and graphs."""
    cfg = published_config(name)
    codes = codes_for(cfg, frames, 2, seed=99)
    ref_model = upstream(name, torch.float32)
    with _true_float32():
        ref = decode_with_noise(ref_model, codes, 0, CUDA)
    del ref_model
    result = {"plain upstream fp16": snr_db(ref, decode_with_noise(upstream(name, torch.float16), codes, 0, CUDA))}
    for label, kw in (("snac-fast eager fp16", {"cuda_graphs": False}), ("snac-fast graphs fp16", {})):
        fast = fast_model(name, **kw)
        out = fast.decode(codes, generator=torch.Generator().manual_seed(0)).float().cpu()
        result[label] = snr_db(ref, out)
    try:  # the same noise through the compiled decode (the noise draw itself may break the graph)
        model = fast_model(name, cuda_graphs=False).model
        compiled = torch.compile(model.decode, mode="reduce-overhead")
        result["snac-fast + compile reduce-overhead"] = snr_db(ref, decode_with_noise(model, codes, 0, CUDA, compiled))
    except Exception:  # reported by its absence; the timing loop records why it fails
        traceback.print_exc()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="snac_24khz")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/decode"))
    ap.add_argument("--skip", nargs="*", default=[], help="skip modes whose label contains any of these")
    ap.add_argument("--workloads", nargs="*", help="only these workload labels' first words (stream, 5, 60)")
    args = ap.parse_args()
    cfg = published_config(args.model)
    loads = workloads(args.model)
    if args.workloads:
        loads = [w for w in loads if any(w[0].startswith(p) for p in args.workloads) or w[0] in args.workloads]
    results = {}
    failed = {}
    for mode in modes(args.model, set(args.skip)):
        t0 = time.perf_counter()
        fn = mode.build()
        build_s = time.perf_counter() - t0
        for label, frames, batch in loads:
            sets = [codes_for(cfg, frames, batch, seed) for seed in range(N_SETS)]
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()  # peak includes compile, graph capture and warm-up
            t0 = time.perf_counter()
            try:
                run_inference(fn, sets[0])  # first call: compiles, captures graphs, autotunes
            except Exception as err:  # report it and go on: the other modes' figures still count
                failed[f"{mode.label} / {label}"] = f"{type(err).__name__}: {err}"[:2000]
                traceback.print_exc()
                break
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            reps = 10 if frames > 100 else 30
            times = time_calls(lambda c, fn=fn: run_inference(fn, c), sets, warmup=3, reps=reps)
            peak = torch.cuda.max_memory_allocated() / 2**20
            ms = statistics.median(times)
            audio_s = frames * cfg["vq_strides"][0] * _hop(cfg) * batch / cfg["sampling_rate"]
            results.setdefault(label, {})[mode.label] = {
                "median_ms": ms, "min_ms": min(times), "rtf": audio_s / (ms / 1e3), "peak_mib": peak,
                "first_call_s": first_s, "build_s": build_s,
            }
            print(f"{mode.label:<38} {label:<18} {ms:9.3f} ms  peak {peak:8.0f} MiB  first call {first_s:6.1f} s", flush=True)
        del fn
        gc.collect()
        torch.cuda.empty_cache()
    fid_frames = next(f for lbl, f, b in workloads(args.model) if lbl.startswith("5 s"))
    fid = fidelity(args.model, fid_frames)
    print("fidelity (SNR dB vs upstream fp32):", {k: round(v, 2) for k, v in fid.items()})
    env = environment()
    base = ["upstream eager fp32", "compile reduce-overhead fp16"]
    header = ["workload", "mode", "median ms", "× realtime", "peak MiB", "vs eager fp32", "vs compile r-o", "first call s"]
    rows = []
    for label, by_mode in results.items():
        for mode, r in by_mode.items():
            vs = [f"{by_mode[b]['median_ms'] / r['median_ms']:.2f}x" if b in by_mode else "-" for b in base]
            rows.append([label, mode, f"{r['median_ms']:.3f}", f"{r['rtf']:.0f}", f"{r['peak_mib']:.0f}", *vs, f"{r['first_call_s']:.1f}"])
    md = (f"# Decode benchmark: {args.model}\n\n{env['device']}, {env['date']}, torch {env['torch']}, triton {env['triton']}. "
          "Latency per call (wall clock with synchronize), median over 3 rotated code sets after warm-up; "
          "synthetic seeded weights. 'first call' includes compilation or graph capture.\n\n"
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
