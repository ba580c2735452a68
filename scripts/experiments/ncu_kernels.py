"""Nsight Compute of one decode's kernels (GPU): each kernel's time, DRAM bytes, throughput against
the GPU's peaks, occupancy, registers and warp stall reasons, for the floor accounting of
docs/kernels.md. Run it under ncu (the decode of interest is the one inside the profiler range):

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --metrics dram__bytes_read.sum,dram__bytes_write.sum \
        --csv --page raw python scripts/experiments/ncu_kernels.py --seconds 60 > ncu.csv
    python scripts/experiments/ncu_kernels.py --table ncu.csv

The decode runs eagerly (no CUDA graph), fp16, on a synthetic checkpoint; without ncu it only decodes.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path


def decode_once(model: str, seconds: float, batch: int) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench_decode import codes_for

    from snac_fast import FastSNAC
    from snac_fast.configs import published_config
    from snac_fast.synthetic import synthetic_model

    cfg = published_config(model)
    hop = 1
    for r in cfg["encoder_rates"]:
        hop *= r
    step = 4 if cfg["attn_window_size"] else 1
    frames = max(step, round(seconds * cfg["sampling_rate"] / (cfg["vq_strides"][0] * hop) / step) * step)
    codec = FastSNAC(synthetic_model(model), device="cuda", dtype=torch.float16, cuda_graphs=False)
    codes = codes_for(cfg, frames, batch, seed=0)
    for _ in range(2):  # compiles, autotunes, caches
        codec.decode(codes, seed=0)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    codec.decode(codes, seed=0)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


METRICS = {  # column: ncu's raw metric
    "us": "gpu__time_duration.sum",
    "dram_read": "dram__bytes_read.sum",
    "dram_write": "dram__bytes_write.sum",
    "mem_pct": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "sm_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "registers": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
}
STALL = "smsp__average_warps_issue_stalled_"
BYTES = {"byte": 1, "B": 1, "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1e6, "MB": 1e6, "Gbyte": 1e9, "GB": 1e9}
MICROSECONDS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1, "usecond": 1, "ms": 1e3, "msecond": 1e3}


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def table(path: Path, peak_tb_s: float) -> str:
    """A Markdown table of ncu's raw CSV: one row per kernel in launch order."""
    text = path.read_text()
    text = text[text.index('"ID"'):]  # after the program's own output and ncu's log lines
    rows = list(csv.reader(io.StringIO(text)))
    header, units, data = rows[0], rows[1], rows[2:]
    col = {name: k for k, name in enumerate(header)}
    scale = {"dram_read": 1, "dram_write": 1}
    out = ["| # | kernel | grid × block | regs | µs | DRAM MB (r / w) | TB/s | of peak | mem % | SM % | occupancy % | top stalls (warps per issue) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    total_us = total_bytes = 0.0
    for n, row in enumerate(data):
        get = {k: _number(row[col[m]]) if m in col else None for k, m in METRICS.items()}
        for k in scale:  # bytes in whatever unit ncu chose
            unit = units[col[METRICS[k]]] if METRICS[k] in col else "byte"
            get[k] = (get[k] or 0) * BYTES.get(unit, 1)
        us = (get["us"] or 0) * MICROSECONDS.get(units[col[METRICS["us"]]], 1)
        moved = get["dram_read"] + get["dram_write"]
        total_us, total_bytes = total_us + us, total_bytes + moved
        stalls = sorted(((_number(row[k]) or 0, name[len(STALL):].split("_per_issue")[0]) for name, k in col.items()
                         if name.startswith(STALL) and name.endswith("_per_issue_active.ratio")
                         and "not_issued" not in name), reverse=True)[:3]
        tb_s = moved / (us * 1e-6) / 1e12 if us else 0
        name = row[col["Kernel Name"]].split("(")[0]
        out.append(f"| {n} | {name} | {get['grid']:.0f} × {get['block']:.0f} | {get['registers']:.0f} | {us:.1f} | "
                   f"{get['dram_read'] / 1e6:.1f} / {get['dram_write'] / 1e6:.1f} | {tb_s:.2f} | {tb_s / peak_tb_s:.0%} | "
                   f"{get['mem_pct'] or 0:.0f} | {get['sm_pct'] or 0:.0f} | {get['occupancy_pct'] or 0:.0f} | "
                   + ", ".join(f"{s} {v:.1f}" for v, s in stalls) + " |")
    out.append(f"\n{len(data)} kernels, {total_us:.0f} µs of kernel time, {total_bytes / 1e6:.0f} MB of DRAM traffic "
               f"({total_bytes / (total_us * 1e-6) / 1e12:.2f} TB/s over the kernels' time; the floor at "
               f"{peak_tb_s} TB/s moves it in {total_bytes / peak_tb_s / 1e6:.0f} µs)." if total_us else "")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="snac_24khz")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--table", type=Path, help="print the table of this ncu CSV instead of decoding")
    ap.add_argument("--peak-tb-s", type=float, default=3.35, help="the GPU's DRAM bandwidth (H100 SXM: 3.35)")
    args = ap.parse_args()
    if args.table:
        print(table(args.table, args.peak_tb_s))
    else:
        decode_once(args.model, args.seconds, args.batch)


if __name__ == "__main__":
    main()
