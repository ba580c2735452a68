"""A new benchmark report in place of a committed one, the committed one kept inside it as an earlier
section (benchmarks/ holds at most 40 files, so a rerun replaces its report instead of adding one):

    python scripts/nest_report.py r/serve_http_first_audio_24khz.json \\
        benchmarks/serve_http_first_audio_24khz_h100 --earlier earlier_h100_732bbee \\
        --title "the H100 run on 732bbee" --tree de9ffb6 --note "one H100 lease, gpu_record.sh first"

or, with ``--section``, a run added beside the report's own (an A/B, a variant) under a key of its own:

    python scripts/nest_report.py r/serve_http_trim_on.json r/serve_http_trim_off.json ... \\
        benchmarks/serve_http_formats_24khz_h100 --section memory_trim --title "..." --text "..."

Markdown: the nested report's headings one level down, under a heading naming its JSON key.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def written(path: Path, report: dict, like: str) -> None:
    """``report`` as JSON at ``path``, indented as ``like`` (the file it replaces) was."""
    lines = like.splitlines()
    indent = len(lines[1]) - len(lines[1].lstrip()) if len(lines) > 1 else 2
    path.write_text(json.dumps(report, indent=indent or None, default=str) + "\n")


def demoted(markdown: str) -> str:
    """Every heading one level down."""
    return re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", markdown, flags=re.M)


def nest(new_json: Path, target: Path, earlier: str, title: str, tree: str, note: str) -> None:
    """``target``.json/.md replaced by ``new_json``'s report, the old one under ``earlier``."""
    old_text = target.with_suffix(".json").read_text()
    old, new = json.loads(old_text), json.loads(new_json.read_text())
    new["tree"] = tree
    new[earlier] = old
    old_md = target.with_suffix(".md").read_text()
    new_md = new_json.with_suffix(".md").read_text().rstrip("\n").splitlines()
    head, body = new_md[0], "\n".join(new_md[1:]).strip("\n")
    text = (f"{head}\n\nRun on the tree of commit {tree} ({note}; the earlier section is {title}).\n\n{body}\n\n\n"
            f"## Earlier: {title} (the JSON's `{earlier}`)\n\n{demoted(old_md).strip()}\n")
    written(target.with_suffix(".json"), new, old_text)
    target.with_suffix(".md").write_text(text)


def add_section(runs: list[Path], target: Path, key: str, title: str, text: str) -> None:
    """The reports ``runs`` (in order) under ``key`` of ``target``'s JSON, and their tables as a
    section of its Markdown (replacing a section of the same key)."""
    old_text = target.with_suffix(".json").read_text()
    report = json.loads(old_text)
    report[key] = {"runs": [dict(json.loads(run.read_text()), name=run.stem) for run in runs], "note": text}
    markdown = target.with_suffix(".md").read_text()
    marker = f"(the JSON's `{key}`)"
    if marker in markdown:  # the section runs to the next heading of its level or the end
        start = markdown.rindex("\n## ", 0, markdown.index(marker))
        after = markdown.find("\n## ", start + 1)
        markdown = markdown[:start] + (markdown[after:] if after >= 0 else "\n")
    parts = [f"\n## {title} {marker}\n\n{text}\n"]
    for run in runs:
        tables = demoted(demoted(run.with_suffix(".md").read_text())).split("\n", 1)[1].strip()
        parts.append(f"\n### {run.stem}\n\n{tables}\n")
    earlier = markdown.find("\n## Earlier: ")  # the section goes before the earlier runs
    at = earlier if earlier >= 0 else len(markdown)
    markdown = markdown[:at].rstrip("\n") + "\n" + "".join(parts) + "\n" + markdown[at:].lstrip("\n")
    written(target.with_suffix(".json"), report, old_text)
    target.with_suffix(".md").write_text(markdown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="the new report(s) (.json, its .md beside it), then the target stem")
    parser.add_argument("--earlier", help="replace the target; its old report under this key")
    parser.add_argument("--section", help="add the reports under this key instead")
    parser.add_argument("--title", required=True, help="the nested or added section's heading")
    parser.add_argument("--tree", default="", help="--earlier: the commit the new run measured")
    parser.add_argument("--note", default="", help="--earlier: how the new run was made")
    parser.add_argument("--text", default="", help="--section: what the runs compare")
    args = parser.parse_args()
    *runs, target = args.paths
    if bool(args.earlier) == bool(args.section):
        parser.error("give one of --earlier and --section")
    if args.earlier:
        if len(runs) != 1:
            parser.error("--earlier takes one new report")
        nest(runs[0], target, args.earlier, args.title, args.tree, args.note)
    else:
        add_section(runs, target, args.section, args.title, args.text)


if __name__ == "__main__":
    main()
