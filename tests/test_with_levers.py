"""scripts/with_levers.py: a script run with serve's GPU-memory switch turned on in its process."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "with_levers.py"
PROBE = """import sys
from snac_fast.streaming import step_graph
print(sys.argv[1:], step_graph.BUFFERS_OUTSIDE_POOL, __name__)
"""


def run(tmp_path, *flags) -> str:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    return subprocess.run([sys.executable, str(SCRIPT), *flags, str(probe), "--out", "x", "-q"], check=True,
                          capture_output=True, text=True).stdout.strip()


def test_the_script_runs_as_main_with_its_own_arguments_and_the_switch_as_asked(tmp_path):
    assert run(tmp_path) == "['--out', 'x', '-q'] False __main__"
    assert run(tmp_path, "--buffers-outside-pool") == "['--out', 'x', '-q'] True __main__"
