#!/usr/bin/env bash
# An older commit's package as an A/B tree for gpu_record.sh ab (carried beside .whl):
#
#   bash scripts/ab_tree.sh 9409443        # -> .ab/9409443/snac_fast
#
# The A/B runs this tree's scripts/bench_serve_http.py over both packages (one measuring tool), and the
# benchmark splits the server's CPU by process name: a tree older than runtime/process_name.py gets
# that module and the two calls that name serve's workers and engine process, nothing else.
set -eu
cd "$(dirname "$0")/.."
rev=${1:?give a commit}
out=.ab/$rev
rm -rf "$out" && mkdir -p "$out"
git archive "$rev" snac_fast | tar x -C "$out"
if [ ! -f "$out/snac_fast/runtime/process_name.py" ]; then
  cp snac_fast/runtime/process_name.py "$out/snac_fast/runtime/"
  python3 - "$out" <<'PY'
import sys
from pathlib import Path

root = Path(sys.argv[1]) / "snac_fast" / "serve"
for path, anchor, call in [
        (root / "engine" / "process.py", "    sys.setswitchinterval(0.001)\n", "ENGINE_NAME"),
        (root / "workers.py", "    import uvicorn\n", "WORKER_NAME")]:
    text = path.read_text()
    if anchor not in text:
        sys.exit(f"{path}: no {anchor.strip()!r} to name the process after")
    line = f"    from snac_fast.runtime.process_name import {call}, name_process; name_process({call})\n"
    path.write_text(text.replace(anchor, anchor + line, 1))
PY
fi
echo "$out"
