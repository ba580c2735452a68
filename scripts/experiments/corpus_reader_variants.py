"""Reader variants of the local corpus engine (GPU): each run's wall time, when its first batch was
launched, each launch round's host and GPU times and the GPU's busy time (CUDA events around each
round's launches; this replaced corpus_timeline.py), the reader tasks' times
(logged by the reader processes) and when the readers were forked, collected and joined. Variants
(alternating run by run in one process, after one warm-up run): the reading threads per reader
process, whether the readers are released after the last shard's read, and the resampler
(``resample_mono``, or torchaudio's functional resample per file as before 2026-11-27's change).

    python scripts/experiments/corpus_reader_variants.py --files 6000 --rounds 3 --corpus distinct --variants old,new1,new2

``--corpus repeated``: bench_encode's corpus (200 clips, hard-linked: 200 distinct lengths);
``distinct``: every file a distinct length, as in a real corpus. Results: docs/datasets.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_encode import write_corpus  # noqa: E402

from snac_fast import FastSNAC, datasets  # noqa: E402
from snac_fast.datasets import encode as E  # noqa: E402
from snac_fast.datasets import local_engine as L  # noqa: E402
from snac_fast.datasets import inputs as I  # noqa: E402
from snac_fast.datasets import readers as R  # noqa: E402
from snac_fast.synthetic import synthetic_model  # noqa: E402

LOG = "/dev/shm/snac-fast-reader-variants"
EV = []  # parent events (name, t0, t1, extra)
_orig_read, _orig_start = R._read_clips, R._start_reader


def timed_read(items, rate, dtype, spool):
    t0 = time.perf_counter()
    out = _orig_read(items, rate, dtype, spool)
    with open(f"{LOG}.{os.getpid()}", "a") as f:
        f.write(json.dumps(["task", t0, time.perf_counter(), len(items)]) + "\n")
    return out


def timed_start(*args):
    t0 = time.perf_counter()
    _orig_start(*args)
    with open(f"{LOG}.{os.getpid()}", "a") as f:
        f.write(json.dumps(["start", t0, time.perf_counter(), 0]) + "\n")


R._read_clips, R._start_reader = timed_read, timed_start


def wrap(obj, name, label):
    orig = getattr(obj, name)

    def inner(*a, **k):
        t0 = time.perf_counter()
        out = orig(*a, **k)
        EV.append((label, t0, time.perf_counter()))
        return out
    setattr(obj, name, inner)


wrap(E, "_start_reading", "start_reading")
wrap(R._Readers, "collect", "collect")
wrap(L, "write_shard", "write")
wrap(R._Readers, "__exit__", "readers_exit")
wrap(R._Readers, "__init__", "readers_init")
_orig_launch = L.launch_batches


def timed_launch(codec, batches, graphs=None):
    t0 = time.perf_counter()
    e0 = torch.cuda.Event(enable_timing=True); e0.record()
    out = _orig_launch(codec, batches, graphs)
    e1 = torch.cuda.Event(enable_timing=True); e1.record()
    EV.append(("launch", t0, time.perf_counter(), e0, e1, len(batches)))
    return out


L.launch_batches = timed_launch


def run(codec, folder, out, label):
    for p in glob.glob(LOG + ".*"):
        os.unlink(p)
    EV.clear()
    torch.cuda.synchronize()
    ref = torch.cuda.Event(enable_timing=True); ref.record()
    t_start = time.perf_counter()
    s = datasets.encode_dataset(folder, out, codec, progress=False)
    torch.cuda.synchronize()
    t_end = time.perf_counter()
    rel = lambda t: round(t - t_start, 4)
    child = []
    for p in glob.glob(LOG + ".*"):
        for line in open(p):
            kind, a, b, n = json.loads(line)
            child.append((kind, a, b, n, p))
    starts = sorted(c[1] for c in child if c[0] == "start")
    tasks = sorted((c for c in child if c[0] == "task"), key=lambda c: c[1])
    launches = [e for e in EV if e[0] == "launch"]
    gpu = [(ref.elapsed_time(e[3]) / 1e3, ref.elapsed_time(e[4]) / 1e3) for e in launches]
    rounds = [(rel(e[1]), round(e[2] - e[1], 4), round(g0, 4), round(g1, 4), e[5]) for e, (g0, g1) in zip(launches, gpu)]
    res = {"label": label, "wall": s["wall_seconds"], "wall_outer": t_end - t_start,
           "readers_init": [(rel(e[1]), round(e[2] - e[1], 4)) for e in EV if e[0] == "readers_init"],
           "start_reading": [(rel(e[1]), round(e[2] - e[1], 4)) for e in EV if e[0] == "start_reading"],
           "child_first_start": rel(starts[0]) if starts else None, "child_last_start": rel(starts[-1]) if starts else None,
           "first_task_start": rel(tasks[0][1]) if tasks else None,
           "task_ms_first32": [round((t[2] - t[1]) * 1e3, 1) for t in tasks[:32]],
           "task_ms_median_all": statistics.median((t[2] - t[1]) * 1e3 for t in tasks) if tasks else None,
           "task_ms_median_after_64": statistics.median((t[2] - t[1]) * 1e3 for t in tasks[64:]) if len(tasks) > 64 else None,
           "files_per_task": tasks[0][3] if tasks else None,
           "collects": [(rel(e[1]), round(e[2] - e[1], 4)) for e in EV if e[0] == "collect"][:6],
           # per launch round: host start, host seconds, GPU start, GPU end (s from the start), batches
           "rounds": rounds, "first_launch": rounds[0][0] if rounds else None,
           "gpu_end": round(max(g1 for _, g1 in gpu), 4) if gpu else None,
           "gpu_busy_s": None,
           "writes_last": [(rel(e[1]), round(e[2] - e[1], 4)) for e in EV if e[0] == "write"][-6:],
           "write_ms_median": statistics.median((e[2] - e[1]) * 1e3 for e in EV if e[0] == "write"),
           "readers_exit": [(rel(e[1]), round(e[2] - e[1], 4)) for e in EV if e[0] == "readers_exit"]}
    # gpu busy: union of intervals
    busy, cur = 0.0, None
    for g0, g1 in sorted(gpu):
        if cur is None or g0 > cur[1]:
            if cur: busy += cur[1] - cur[0]
            cur = [g0, g1]
        else:
            cur[1] = max(cur[1], g1)
    if cur: busy += cur[1] - cur[0]
    res["gpu_busy_s"] = round(busy, 4)
    return res


def write_distinct(folder: Path, files: int) -> None:
    """``files`` WAVs of distinct lengths (clip n % 200 cut short by n // 200 samples)."""
    import numpy as np
    import soundfile

    from snac_fast.synthetic import speech_like

    rng = np.random.default_rng(1)
    clips = [speech_like(rng.uniform(2, 12), 16000, int(rng.integers(1 << 30))) for _ in range(200)]
    folder.mkdir()
    for n in range(files):
        soundfile.write(folder / f"{n:06d}.wav", clips[n % 200][: clips[n % 200].size - n // 200], 16000)


def main() -> None:
    import torchaudio.functional as AF

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=6000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--corpus", choices=["repeated", "distinct"], default="repeated")
    ap.add_argument("--variants", default="old,new1,new2")
    ap.add_argument("--out", type=Path, help="every run's figures as JSON")
    args = ap.parse_args()
    codec = FastSNAC(synthetic_model("snac_24khz"), device="cuda", dtype=torch.float16, source="synthetic:snac_24khz")
    release, bucketed = R._Readers.release, I.resample_mono

    def functional(mono, rate, new_rate):
        return mono if rate == new_rate else AF.resample(mono, orig_freq=rate, new_freq=new_rate)

    known = {"old": (1, False, functional), "t1r": (1, True, functional), "t2": (2, True, functional),
             "t4": (4, True, functional), "new1": (1, True, bucketed), "new2": (2, True, bucketed),
             "new4": (4, True, bucketed)}
    variants = {name: known[name] for name in args.variants.split(",")}
    results = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "corpus"
        (write_corpus if args.corpus == "repeated" else write_distinct)(folder, args.files)
        run(codec, folder, Path(tmp) / "warm", "warm")
        n = 0
        for r in range(args.rounds):
            for name, (threads, early_release, resample) in variants.items():
                R.THREADS_PER_READER = threads
                R._Readers.release = release if early_release else (lambda self: None)
                I.resample_mono = resample
                results[name].append(run(codec, folder, Path(tmp) / f"o{n}", f"{name}.{r}"))
                n += 1
    for name, rs in results.items():
        print(args.corpus, name, "wall", [round(x["wall"], 3) for x in rs],
              "first launch", [x["first_launch"] for x in rs], "gpu busy", [x["gpu_busy_s"] for x in rs],
              "task ms", [round(x["task_ms_median_after_64"], 1) for x in rs], "files/task", rs[0]["files_per_task"],
              "readers exit", [x["readers_exit"][0][1] for x in rs], flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "corpus": args.corpus,
                                        "files": args.files, "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
