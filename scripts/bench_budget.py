"""What a `--gpu-memory-gb` budget costs (issue 75): for each budget, in a fresh process, the shared
engine of --max-streams slots warmed for the largest call size the budget fits (``fit_max_batch``,
as `snac-fast serve` chooses it), the process's GPU memory as nvidia-smi counts it (NVML), and
the latency of one real-time round of --streams streams (one frame each, with sync), which runs as
several steps where the budget chose smaller ones. A budget that cannot fit is recorded with its
error. Each budget's process runs alone; the rounds are timed after a warm-up, median of --rounds.

    python scripts/bench_budget.py --budgets 1,1.5,2,0 --max-streams 1024,256 --out benchmarks
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import gpu_tag, markdown_table, write_results  # noqa: E402

GB = 1e9


def gigabytes(readings: dict[str, float]) -> dict[str, float]:
    """``memory_readings``' bytes as GB (1e9), named so: ``gpu_process_bytes`` -> ``gpu_process_gb``."""
    return {k.replace("_bytes", "_gb"): v / GB for k, v in readings.items()}


def one(budget: float, max_streams: int, max_batch: int, streams: int, rounds: int) -> dict:
    """In this process: the engine, its budgeted warm-up, NVML's figure and the round latency."""
    import numpy as np
    import torch

    from snac_fast import FastSNAC
    from snac_fast.serve.engine.gpu_memory import fit_max_batch, memory_readings

    codec = FastSNAC.from_pretrained("synthetic:snac_24khz", device="cuda")
    engine = codec.shared_stream_engine(max_streams=max_streams)
    row = {"budget_gb": budget, "max_streams": max_streams}
    chosen = max_batch
    if budget:
        try:
            chosen, figures = fit_max_batch(engine, int(budget * GB), max_batch)
            row["figures"] = figures
        except ValueError as e:
            return {**row, "error": str(e)}
    engine.warmup(max_batch=chosen)
    torch.cuda.empty_cache()
    row.update(call_size=chosen, **gigabytes(memory_readings("cuda")))
    opened = [engine.open(seed=i) for i in range(min(streams, max_streams))]
    rng = np.random.default_rng(0)
    group = engine.frames_per_group
    times = []
    for r in range(rounds + 5):
        pushes = {s: [torch.from_numpy(rng.integers(0, 4096, (1, group * k))) for k in engine.ratios] for s in opened}
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.advance(pushes)
        torch.cuda.synchronize()
        if r >= 5:
            times.append((time.perf_counter() - start) * 1e3)
    row.update(streams=len(opened), round_ms_p50=statistics.median(times), round_ms_max=max(times),
               **{f"after_rounds_{k}": v for k, v in gigabytes(memory_readings("cuda")).items()})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="1,1.5,2,0", help="GB, comma-separated (0: no budget)")
    parser.add_argument("--max-streams", default="1024,256", help="engine slots, comma-separated")
    parser.add_argument("--max-batch", type=int, default=256, help="the call size asked for (serve --max-batch)")
    parser.add_argument("--streams", type=int, default=256, help="streams in each timed round")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # budget,max_streams: run in this process
    parser.add_argument("--out", default=None)
    parser.add_argument("--stem", default=None, help="default: budget_24khz_<gpu>")
    args = parser.parse_args()
    if args.one:
        budget, slots = args.one.split(",")
        print(json.dumps(one(float(budget), int(slots), args.max_batch, args.streams, args.rounds)))
        return
    rows = []
    for slots in [int(s) for s in args.max_streams.split(",")]:
        for budget in [float(b) for b in args.budgets.split(",")]:
            out = subprocess.run([sys.executable, __file__, "--one", f"{budget},{slots}", "--max-batch", str(args.max_batch),
                                  "--streams", str(args.streams), "--rounds", str(args.rounds)],
                                 capture_output=True, text=True)
            lines = out.stdout.strip().splitlines()
            row = json.loads(lines[-1]) if out.returncode == 0 and lines else \
                {"budget_gb": budget, "max_streams": slots, "error": out.stderr[-500:]}
            print(row, flush=True)
            rows.append(row)
    import torch

    table = markdown_table(
        ["--max-streams", "--gpu-memory-gb", "call size chosen", "process GB (nvidia-smi)", "reserved GB",
         "round of N streams p50 / max ms"],
        [[r["max_streams"], r["budget_gb"] or "none", r.get("call_size", "-"),
          f"{r['gpu_process_gb']:.3f}" if "gpu_process_gb" in r else r.get("error", "-")[:160],
          f"{r['gpu_reserved_gb']:.3f}" if "gpu_reserved_gb" in r else "-",
          f"{r['streams']}: {r['round_ms_p50']:.2f} / {r['round_ms_max']:.2f}" if "round_ms_p50" in r else "-"]
         for r in rows])
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    markdown = (f"# What a --gpu-memory-gb budget costs ({device}, {time.strftime('%Y-%m-%d')})\n\n"
                f"`python scripts/bench_budget.py {' '.join(sys.argv[1:])}`: per budget, a fresh process: the shared "
                "engine warmed for the call size `fit_max_batch` chooses (as `snac-fast serve` does), NVML's figure "
                "for the process (the CUDA context included; GB of 1e9 bytes), and one round of real-time pushes "
                "(one frame per stream, with sync), run as several steps where the call size is smaller.\n\n" + table + "\n")
    print(markdown)
    if args.out:
        write_results(Path(args.out), args.stem or f"budget_24khz_{gpu_tag(device)}", {"command": "python scripts/bench_budget.py " + " ".join(sys.argv[1:]),
                                                  "device": device, "rows": rows}, markdown)


if __name__ == "__main__":
    main()
