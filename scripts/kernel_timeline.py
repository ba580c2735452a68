"""The kernels of one profiled call in launch order: GPU time, grid, the op that launched each and
the bytes of that op's tensor inputs (so a kernel's effective bandwidth can be read off).

Used by profile_stream.py and profile_kernels.py (``--timeline``); needs a torch.profiler run with
CPU activity and ``record_shapes=True``. snac-fast's Triton kernels launch outside any torch op in
eager mode, so their op shows as '?' and their bandwidth as 0: read their shapes off the grid.
"""

from __future__ import annotations

import json
import math
import os
import tempfile

_BYTES = {"c10::Half": 2, "c10::BFloat16": 2, "float": 4, "double": 8, "long int": 8, "int": 4}


def _input_bytes(args: dict) -> int:
    total = 0
    for dims, kind in zip(args.get("Input Dims", []), args.get("Input type", [])):
        if isinstance(dims, list) and dims and all(isinstance(d, int) for d in dims):
            total += math.prod(dims) * _BYTES.get(kind, 0)
    return total


def print_timeline(prof, title: str = "") -> None:
    """Print one line per kernel: start offset, GPU µs, grid, launching op, its input dims and the
    GB/s that reading those inputs once would take (a lower bound on the traffic)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    ops = {}
    for e in events:
        if e.get("cat") == "cpu_op" and "External id" in e.get("args", {}):
            ops[e["args"]["External id"]] = e  # the innermost op launched the kernel: later ops overwrite
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels:
        print("(no kernels recorded)")
        return
    t0 = kernels[0]["ts"]
    busy = sum(k["dur"] for k in kernels)
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - t0
    print(f"\n### timeline {title}: {len(kernels)} kernels, {busy:.1f} µs busy over {span:.1f} µs")
    print(f"{'start':>8} {'µs':>7} {'GB/s in':>8}  {'grid':<14} {'kernel':<34} op: input dims")
    for k in kernels:
        op = ops.get(k["args"].get("External id"), {})
        args = op.get("args", {})
        dims = [d for d in args.get("Input Dims", []) if d]
        rate = _input_bytes(args) / (k["dur"] * 1e3) if k["dur"] else 0.0
        grid = "x".join(str(g) for g in k["args"].get("grid", []))
        print(f"{k['ts'] - t0:8.1f} {k['dur']:7.1f} {rate:8.0f}  {grid:<14} {k['name'][:34]:<34} "
              f"{op.get('name', '?')}: {dims}")
