"""scripts/nest_report.py: a rerun in place of its committed report with the old one kept inside it,
and runs added as a section of their own (benchmarks/ holds at most 40 files)."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "nest_report.py"


def report(folder: Path, stem: str, rows: list, title: str, indent: int = 2) -> Path:
    (folder / f"{stem}.json").write_text(json.dumps({"rows": rows, "date": "2026-12-07"}, indent=indent) + "\n")
    (folder / f"{stem}.md").write_text(f"# {title}\n\nCommands: `x`.\n\n## Keeping pace\n\n| a |\n|---|\n| {rows[0]} |\n")
    return folder / f"{stem}.json"


def run(*args) -> None:
    subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], check=True, capture_output=True, text=True)


def test_a_rerun_takes_the_place_of_its_report_and_keeps_the_old_one_inside(tmp_path):
    report(tmp_path, "suite", [1], "old run", indent=1)
    (tmp_path / "new").mkdir()
    new = report(tmp_path / "new", "run", [2], "new run")
    run(new, tmp_path / "suite", "--earlier", "earlier_abc", "--title", "the run on abc", "--tree", "def", "--note", "a lease")
    text = (tmp_path / "suite.json").read_text()
    data = json.loads(text)
    assert data["rows"] == [2] and data["tree"] == "def" and data["earlier_abc"]["rows"] == [1]
    assert text.splitlines()[1].startswith(' "')  # the old file's indent kept
    md = (tmp_path / "suite.md").read_text()
    assert md.startswith("# new run\n\nRun on the tree of commit def (a lease; the earlier section is the run on abc).")
    assert "## Earlier: the run on abc (the JSON's `earlier_abc`)\n\n## old run" in md
    assert "### Keeping pace" in md.split("## Earlier")[1] and md.split("## Earlier")[0].count("## Keeping pace") == 1


def test_runs_added_as_a_section_replace_the_section_of_that_key(tmp_path):
    report(tmp_path, "suite", [1], "the suite")
    (tmp_path / "suite.md").write_text((tmp_path / "suite.md").read_text() + "\n## Earlier: x (the JSON's `e`)\n\nold\n")
    runs = [report(tmp_path, f"run_{k}", [k], f"run {k}") for k in ("a", "b")]
    run(*runs, tmp_path / "suite", "--section", "ab", "--title", "A against B", "--text", "first")
    run(runs[1], tmp_path / "suite", "--section", "ab", "--title", "A against B", "--text", "again")
    data = json.loads((tmp_path / "suite.json").read_text())
    assert data["rows"] == [1] and [r["name"] for r in data["ab"]["runs"]] == ["run_b"] and data["ab"]["note"] == "again"
    md = (tmp_path / "suite.md").read_text()
    assert md.count("(the JSON's `ab`)") == 1 and "first" not in md
    assert md.index("(the JSON's `ab`)") < md.index("## Earlier: x")  # before the earlier runs
    assert "### run_b\n\nCommands: `x`.\n\n#### Keeping pace" in md
