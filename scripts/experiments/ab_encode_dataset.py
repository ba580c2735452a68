"""A/B of the local dataset engine (GPU): ``encode_dataset`` of another checkout's ``snac_fast``
against this one's, on one speech-like corpus, alternating fresh processes (each warms up with one
whole run first, then times a second one).

    git archive <commit> snac_fast | tar -x -C /tmp/base
    python scripts/experiments/ab_encode_dataset.py /tmp/base --files 4000 --rounds 3 --out benchmarks/logs/encode_corpus_ab_h100.json

``--cli``: time instead the whole command a user runs, ``snac-fast encode-dataset CORPUS OUT --model
synthetic:snac_24khz`` in a fresh process (interpreter, imports, model load and the run), after one
untimed run of each side that fills the Triton cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def one_run(corpus: str, out: str) -> None:
    """In a child: warm up, then time encode_dataset of ``corpus`` with whichever snac_fast is on the path."""
    import torch

    from snac_fast import FastSNAC, datasets
    from snac_fast.synthetic import synthetic_model

    codec = FastSNAC(synthetic_model("snac_24khz"), device="cuda", dtype=torch.float16, source="synthetic:snac_24khz")
    datasets.encode_dataset(corpus, out + "-warm", codec, progress=False)
    summary = datasets.encode_dataset(corpus, out, codec, progress=False)
    print("RESULT" + json.dumps({"wall_s": summary["wall_seconds"], "hours": summary["audio_seconds"] / 3600,
                                 "hours_per_minute": summary["audio_seconds"] / 60 / summary["wall_seconds"]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path, help="a folder holding the other snac_fast package")
    ap.add_argument("--files", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/encode_corpus_ab.json"))
    ap.add_argument("--cli", action="store_true", help="time the whole CLI command in a fresh process")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_encode import write_corpus

    tmp = Path(tempfile.mkdtemp())
    write_corpus(tmp / "corpus", args.files)
    results: dict[str, list[dict]] = {}
    sides = (("before", args.base.resolve()), ("after", ROOT))
    for rnd in range(-1 if args.cli else 0, args.rounds):
        for label, path in sides:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
            if args.cli:
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-m", "snac_fast.cli", "encode-dataset", str(tmp / "corpus"),
                                str(tmp / f"{label}{rnd}"), "--model", "synthetic:snac_24khz"],
                               env=env, capture_output=True, check=True)
                if rnd >= 0:  # round -1 fills the Triton cache
                    results.setdefault(label, []).append({"process_s": time.perf_counter() - t0})
                    print(label, rnd, results[label][-1], flush=True)
                continue
            child = subprocess.run([sys.executable, __file__, "--child", str(tmp / "corpus"), str(tmp / f"{label}{rnd}")],
                                   env=env, capture_output=True, text=True, check=True)
            result = json.loads(next(line[6:] for line in child.stdout.splitlines() if line.startswith("RESULT")))
            results.setdefault(label, []).append(result)
            print(label, rnd, result, flush=True)
    args.out.write_text(json.dumps({"files": args.files, **results}, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        one_run(sys.argv[2], sys.argv[3])
    else:
        main()
