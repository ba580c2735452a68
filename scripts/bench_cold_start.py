"""Cold start of a fresh process: import, load, first decode (24 kHz streaming chunk, B=1, 4 frames),
second decode, each in a new Python process, with an empty and with a warm Triton cache, with and
without the concurrent kernel warm-up (:mod:`snac_fast.runtime.warmup`); then the ``snac-fast decode`` CLI's
whole wall clock on a warm cache, with the synthetic model and with the published id read from a
filled hub cache (seeded weights), interleaved with bare ``import torch`` runs. Where site-packages hold no compiled bytecode and
``PYTHONDONTWRITEBYTECODE`` is set (as on the project's GPU machine: ``import torch`` then takes
6.5 s instead of 2.4 s in every process), unset it and set ``PYTHONPYCACHEPREFIX`` to a writable
folder, so that only the first process compiles the bytecode, as after a normal ``pip install``:

    env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pyc python scripts/bench_cold_start.py --out benchmarks
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import environment, markdown_table, write_results  # noqa: E402

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from snac_fast import FastSNAC
t_import = time.perf_counter() - t0
t = time.perf_counter()
codec = FastSNAC.from_pretrained(sys.argv[1], device="cuda")
torch.cuda.synchronize()
t_load = time.perf_counter() - t
s = codec.config["vq_strides"]
codes = [torch.randint(0, 4096, (1, 4 * s[0] // x)) for x in s]
loaded = len(sys.modules)
t = time.perf_counter()
phases = codec.warmup([1], [4]) if sys.argv[2] == "warmup" else {}
codec.decode(codes, seed=1)
torch.cuda.synchronize()
t_first = time.perf_counter() - t
phases["modules_imported_by_first_decode"] = len(sys.modules) - loaded
phases["dynamo_imported"] = "torch._dynamo" in sys.modules
t = time.perf_counter()
codec.decode(codes, seed=1)
torch.cuda.synchronize()
t_second = time.perf_counter() - t
print(json.dumps({"import_s": t_import, "load_s": t_load, "first_decode_s": t_first, "second_decode_s": t_second,
                  "to_first_audio_s": time.perf_counter() - t0 - t_second, **phases}))
"""


def child(model: str, mode: str, cache: str) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": cache}
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, model, mode], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["process_s"] = time.perf_counter() - t
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="synthetic:snac_24khz")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cli-runs", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    def import_torch() -> float:  # the floor of any process that uses torch, for scale
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        return time.perf_counter() - t

    import_torch()  # a fresh machine reads torch's libraries from disk once
    rows = []
    for mode in ("plain", "warmup"):
        for r in range(args.repeats):
            with tempfile.TemporaryDirectory() as cache:
                empty = child(args.model, mode, cache)
                warm = child(args.model, mode, cache)
            rows += [{"mode": mode, "cache": "empty", **empty}, {"mode": mode, "cache": "warm", **warm}]
            print(rows[-2], rows[-1], flush=True)
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as tmp:
        # the published model's path as a user runs it offline: its hub cache (seeded weights here)
        from snac_fast.model.synthetic import fill_hub_cache, make_checkpoint

        hub_id = "hubertsiuzdak/snac_24khz"
        fill_hub_cache(f"{tmp}/hub", hub_id, make_checkpoint(f"{tmp}/checkpoint", "snac_24khz"))
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "HF_HUB_CACHE": f"{tmp}/hub", "HF_HUB_OFFLINE": "1"}
        # the sample holds 18 frames: warm the shapes you will serve
        subprocess.run([sys.executable, "-m", "snac_fast.cli", "warmup", "--model", args.model, "--frames", "4,18"],
                       env=env, check=True)
        runs = {"torch": [], "cli": [], "cli_hub": []}
        for _ in range(args.cli_runs):  # interleaved: the same state of the page cache
            runs["torch"].append(import_torch())
            for key, model in (("cli", args.model), ("cli_hub", hub_id)):
                t = time.perf_counter()
                subprocess.run([sys.executable, "-m", "snac_fast.cli", "decode", "samples/snac_24khz.pt", f"{tmp}/out.wav",
                                "--model", model], env=env, check=True)
                runs[key].append(time.perf_counter() - t)
        cli, cli_hub, torch_import_s = (statistics.median(runs[k]) for k in ("cli", "cli_hub", "torch"))
    cli_runs, torch_imports = runs["cli"], runs["torch"]
    print("cli decode, warm cache:", runs)
    results = {"environment": environment(), "model": args.model, "rows": rows, "cli_decode_warm_cache_s": cli,
               "cli_decode_runs_s": cli_runs, "cli_decode_hub_cache_s": cli_hub, "cli_decode_hub_runs_s": runs["cli_hub"],
               "python_import_torch_runs_s": torch_imports,
               "threads": os.cpu_count(),
               "python_import_torch_process_s": torch_import_s, "dont_write_bytecode": sys.flags.dont_write_bytecode,
               "pythonpycacheprefix": os.environ.get("PYTHONPYCACHEPREFIX")}
    keys = ["import_s", "load_s", "first_decode_s", "to_first_audio_s", "process_s"]
    md = [f"# Cold start, {args.model}: {results['environment']['device']}, {results['environment']['date']}\n",
          "Fresh process each row; first decode = 24 kHz streaming chunk (B=1, 4 frames) with sync, including "
          "kernel compilation (empty cache) or loading (warm cache), CUDA graph capture and warm-up decodes. "
          "mode warmup: `codec.warmup([1], [4])` (concurrent compilation) before the first decode.\n",
          markdown_table(["mode", "Triton cache"] + [k[:-2] + " s" for k in keys] + ["modules imported by first decode"],
                         [[r["mode"], r["cache"]] + [f"{r[k]:.2f}" for k in keys] + [r["modules_imported_by_first_decode"]]
                          for r in rows]),
          f"\n`snac-fast decode samples/snac_24khz.pt out.wav --model {args.model}` after `snac-fast warmup`: "
          f"{cli:.2f} s of wall clock in total, median of {len(cli_runs)} runs ({', '.join(f'{c:.2f}' for c in cli_runs)}; "
          f"after `snac-fast warmup --frames 4,18`). With `--model {hub_id}` read from a filled hub cache "
          f"(`HF_HUB_OFFLINE=1`, seeded weights in the published layout), as a user runs it: {cli_hub:.2f} s "
          f"({', '.join(f'{c:.2f}' for c in runs['cli_hub'])}). "
          f"PYTHONPYCACHEPREFIX: {os.environ.get('PYTHONPYCACHEPREFIX') or 'unset'}. "
          f"For scale, `python -c 'import torch'` alone, interleaved with those runs: {torch_import_s:.2f} s (median of {len(torch_imports)}: "
          f"{', '.join(f'{c:.2f}' for c in torch_imports)}).\n"]
    print("\n".join(md))
    if args.out:
        import torch

        name = torch.cuda.get_device_name(0).lower()
        tag = "h100" if "h100" in name else "h200" if "h200" in name else "gpu"
        write_results(Path(args.out), f"cold_start_{tag}", results, "\n".join(md))


if __name__ == "__main__":
    main()
