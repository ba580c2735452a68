"""The package itself: what it exports, what README says of it."""


def test_package_exports_what_readme_imports():
    """README's streaming and serving names come from the package itself, lazily: importing
    snac_fast alone does not import the batchers."""
    import subprocess
    import sys

    import snac_fast
    from snac_fast.orpheus import ORPHEUS
    from snac_fast.serve import AsyncStreamBatcher

    assert snac_fast.ORPHEUS is ORPHEUS and snac_fast.AsyncStreamBatcher is AsyncStreamBatcher
    assert set(snac_fast.__all__) >= {"FastSNAC", "ORPHEUS", "AsyncStreamBatcher", "StreamBatcher", "DecoderStream"}
    probe = "import sys, snac_fast; print('snac_fast.batching.batchers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_every_environment_switch_is_in_the_readme():
    """README lists every SNAC_FAST_* variable the package reads: a new switch fails here until it is."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    names = {m for path in (root / "snac_fast").rglob("*.py") for m in re.findall(r"SNAC_FAST_[A-Z0-9_]+", path.read_text())}
    assert {"SNAC_FAST_GPU_LIMITS", "SNAC_FAST_PDL", "SNAC_FAST_COMPILE_FORK"} <= names
    readme = (root / "README.md").read_text()
    assert [n for n in sorted(names) if n not in readme] == []


def test_readme_is_short_and_its_speed_table_is_the_figures_of_record():
    """README.md stays a user's page (at most 8,000 bytes), and its speed table and
    benchmarks/figures.json are what scripts/figures.py reads from the reports under benchmarks/."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    assert len((root / "README.md").read_bytes()) <= 8000
    check = subprocess.run([sys.executable, str(root / "scripts" / "figures.py"), "--check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
