"""The figures of record: read the latest report of each suite under benchmarks/, write them to
benchmarks/figures.json, and write README.md's speed table from them (between its markers).

    python scripts/figures.py            # rewrite both
    python scripts/figures.py --check    # exit 1 if either is stale (tests/test_package.py runs it)

Each figure names the report it comes from, the GPU and date the report records, and the commit
that last wrote the report (git), so the table's one caption is true of every row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
FIGURES = BENCH / "figures.json"
README = ROOT / "README.md"
BEGIN, END = "<!-- speed table: scripts/figures.py -->", "<!-- end of speed table -->"
PEERS = ("compile r-o fp16 autocast", "compile r-o fp16 folded")  # the faster of the two is the peer
DECODE_WORKLOADS = {"stream chunk, B=1": "stream n=4 B=1", "stream chunk, B=32": "stream n=4 B=32",
                    "5 s": "5 s ", "60 s": "60 s "}
ENCODE_WORKLOADS = {"encode 10 s, B=1": "10 s B=1", "encode 10 s, B=32": "10 s B=32", "encode 60 s": "60 s B=1"}
RATES = ("24", "32", "44")


def _commit(path: Path) -> str:
    out = subprocess.run(["git", "log", "-1", "--format=%h", "--", str(path)], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "uncommitted"


def _source(path: Path, report: dict) -> dict:
    env = report.get("environment", report)
    return {"report": path.name, "device": env["device"], "date": env["date"], "commit": _commit(path)}


def _pair(modes: dict) -> dict:
    peer = min(modes[p]["median_ms"] for p in PEERS)
    ours = modes["snac-fast fp16"]["median_ms"]
    return {"peer_ms": round(peer, 3), "snac_fast_ms": round(ours, 3), "speedup": round(peer / ours, 2)}


def collect() -> dict:
    """Every figure of record, with its source."""
    figures: dict = {"decode": {}, "encode": {}, "stream_step": {}, "streams_per_gpu": {}}
    for rate in RATES:
        path = BENCH / f"decode_{rate}khz_h100.json"
        report = json.loads(path.read_text())
        rows = {}
        for label, prefix in DECODE_WORKLOADS.items():
            name = next(k for k in report["results"] if k.startswith(prefix))
            rows[label] = _pair(report["results"][name])
        figures["decode"][f"{rate} kHz"] = {"source": _source(path, report), "rows": rows}
        path = BENCH / f"encode_{rate}khz_h100.json"
        if path.exists():
            report = json.loads(path.read_text())
            figures["encode"][f"{rate} kHz"] = {"source": _source(path, report),
                                                "rows": {label: _pair(report["encode"][name])
                                                         for label, name in ENCODE_WORKLOADS.items()}}
    path = BENCH / "stream_24khz_h100.json"
    report = json.loads(path.read_text())
    steps = {}
    for row in report["rows"]:
        if row["streams"] in (1, 64):
            peer = min(row["window_compile_fp16"]["call_ms"], row["window_compile_fp16_folded"]["call_ms"])
            ours = row["engine_batched"]["call_ms"]
            steps[f"{row['streams']} stream" + ("s" if row["streams"] > 1 else "")] = {"peer_ms": round(peer, 3), "snac_fast_ms": round(ours, 3),
                                                  "speedup": round(peer / ours, 2)}
    figures["stream_step"]["24 kHz"] = {"source": _source(path, report), "rows": steps}
    path = BENCH / "serve_24khz_h200.json"
    report = json.loads(path.read_text())
    for key, label in (("one_process_ids_60s", "one process"), ("engine_process_4096_60s", "one engine process")):
        part = report[key]
        top = max(r["streams"] for r in part["rows"])
        row = max((r for r in part["rows"] if r["streams"] == top), key=lambda r: r["p99_ms"])  # the worst run
        figures["streams_per_gpu"][label] = {
            "source": {**_source(path, part), "report": f"{path.name} ({key})"},
            "streams": row["streams"], "pace": row["pace"], "p50_ms": round(row["p50_ms"], 1),
            "p99_ms": round(row["p99_ms"], 1), "max_ms": round(row["max_ms"], 1), "late": row["late_pushes"],
            "keeps_pace": row["keeps_pace"]}
    return figures


def table(figures: dict) -> str:
    """README's speed table: per call with sync, fp16, snac-fast against the compile peer."""
    sources = [v["source"] for group in figures.values() for v in group.values()]
    by_device: dict[str, set] = {}
    for source in sources:
        by_device.setdefault(source["device"], set()).add(source["commit"])
    caption = ("fp16, per call with sync, against upstream under static-shape `torch.compile` (the faster of two "
               "fp16 builds) compiled for each workload; " + "; ".join(
                   f"{device}, reports of {', '.join(sorted(commits))}" for device, commits in sorted(by_device.items()))
               + " ([method](benchmarks/README.md)).")
    lines = [caption, "", "| workload | " + " | ".join(f"{r} kHz" for r in RATES) + " |",
             "|---|" + "---|" * len(RATES)]

    def cell(entry: dict | None) -> str:
        return "–" if entry is None else f"{entry['snac_fast_ms']:.3g} ms (**{entry['speedup']:.1f}×**)"
    for label in DECODE_WORKLOADS:
        lines.append(f"| decode {label} | " + " | ".join(cell(figures["decode"][f"{r} kHz"]["rows"][label])
                                                       for r in RATES) + " |")
    for label in ENCODE_WORKLOADS:
        lines.append(f"| {label} | " + " | ".join(cell(figures["encode"].get(f"{r} kHz", {}).get("rows", {}).get(label))
                                                  for r in RATES) + " |")
    for label, entry in figures["stream_step"]["24 kHz"]["rows"].items():
        lines.append(f"| stream step, {label} (peer: 4-frame window) | {cell(entry)} | – | – |")
    for label, entry in figures["streams_per_gpu"].items():
        lines.append(f"| real-time streams, {label} | {entry['streams']:,}, p99 {entry['p99_ms']} ms, "
                     f"{entry['late']} late | – | – |")
    return "\n".join(lines)


def _without_commits(text: str) -> str:
    import re

    return re.sub(r'("commit": "[^"]*"| at [0-9a-f]{7,}\b| at uncommitted)', "", text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if figures.json or README's table is stale")
    args = parser.parse_args()
    figures = collect()
    text = json.dumps(figures, indent=1) + "\n"
    readme = README.read_text()
    if BEGIN not in readme or END not in readme:
        print(f"README.md lacks the markers {BEGIN} ... {END}", file=sys.stderr)
        return 1
    head, rest = readme.split(BEGIN, 1)
    new_readme = head + BEGIN + "\n" + table(figures) + "\n" + END + rest.split(END, 1)[1]
    if args.check:  # the figures and the table's rows; commits aside (a shallow clone's git log differs)
        stale = [p.name for p, new in ((FIGURES, text), (README, new_readme))
                 if not p.exists() or _without_commits(p.read_text()) != _without_commits(new)]
        if stale:
            print(f"stale: {', '.join(stale)}; run python scripts/figures.py", file=sys.stderr)
            return 1
        return 0
    FIGURES.write_text(text)
    README.write_text(new_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
