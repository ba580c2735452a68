"""GPU time of a padded-batch encode with and without exact rows (``lengths``), fp16, eager
(no CUDA graphs, as the dataset engine runs it). Results: docs/datasets.md.

    python scripts/experiments/encode_rows_cost.py
"""
import json, statistics, torch
from snac_fast import FastSNAC
from snac_fast.synthetic import synthetic_model
fast = FastSNAC(synthetic_model("snac_24khz"), device="cuda", dtype=torch.float16)
rate = fast.sampling_rate
out = {}
for rows, seconds in [(16, 10.0), (64, 4.0), (4, 30.0)]:
    T = int(seconds * rate)
    gen = torch.Generator(device="cuda").manual_seed(0)
    audio = torch.randn(rows, 1, T, device="cuda", generator=gen) * 0.1
    lengths = [T - (i * rate // 8) % (rate // 2) for i in range(rows)]
    for _ in range(3):
        fast.encode(audio, cuda_graphs=False, check_finite=False); fast.encode(audio, lengths=lengths, cuda_graphs=False, check_finite=False)
    times = {"plain": [], "lengths": []}
    for _ in range(15):
        for key in times:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fast.encode(audio, lengths=lengths if key == "lengths" else None, cuda_graphs=False, check_finite=False)
            e.record(); e.synchronize()
            times[key].append(s.elapsed_time(e))
    med = {k: statistics.median(v) for k, v in times.items()}
    out[f"{rows}x{seconds}s"] = med | {"ratio": med["lengths"] / med["plain"]}
    print(rows, seconds, med, med["lengths"] / med["plain"], flush=True)
print(json.dumps(out))
