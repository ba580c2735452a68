"""Where a serving load's slow pushes come from (GPU): one in-process load of ``bench_serve.py``
(``AsyncStreamBatcher.push_ids``) with three probes running beside it, to tell a stall of the
process from one of the host or of the GPU:

- a thread of this process that sleeps 1 ms at a time and records each wake-up later than 4 ms
  (it needs the GIL to record: a stall of this process's interpreter shows here);
- a separate probe process without torch doing the same (a stall of the whole host, or of the
  virtual machine, shows there too);
- every engine call's GPU span (CUDA events, the batcher's own) with its host time, and the host's
  ``/proc/stat`` steal time and this process's context switches over the load.

Prints, per stall of the slow pushes (a cluster of pushes over 20 ms), what each probe saw in the
same window, and writes the raw records as JSON.

    python scripts/experiments/serve_stalls.py --scenario 64@2 --seconds 20 --out /tmp/stalls.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_serve  # noqa: E402

from snac_fast import serving  # noqa: E402

PROBE = """
import sys, time
late, period, threshold = [], 0.001, 0.004
end = time.perf_counter() + float(sys.argv[1])
last = time.perf_counter()
while last < end:
    time.sleep(period)
    now = time.perf_counter()
    if now - last > threshold:
        late.append((time.clock_gettime(time.CLOCK_MONOTONIC) - (now - last), (now - last) * 1e3))
    last = now
print(repr(late))
"""


def sleep_probe(stop: threading.Event, late: list) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        if now - last > 0.004:
            late.append((time.monotonic() - (now - last), (now - last) * 1e3))
        last = now


def steal_ticks() -> tuple[int, int]:
    """(steal, all) jiffies of the host's CPUs so far (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[7], sum(fields)


def context_switches() -> dict:
    with open("/proc/self/status") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f if "ctxt_switches" in line)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="64@2")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    cli = parser.parse_args()
    streams, pace = int(cli.scenario.split("@")[0]), float(cli.scenario.split("@")[1])
    args = argparse.Namespace(model="snac_24khz", seconds=cli.seconds, max_batch=cli.max_batch, max_wait_ms=0.0,
                              max_streams=streams, output="int16", gc_freeze=False, spin_gpu=0.0, uvloop=False)
    codec, engine, _ = bench_serve.build(args, torch.device(cli.device))
    pool = bench_serve.make_pool(codec.config, int(cli.seconds * pace * 12) + 8)

    calls = []  # (host monotonic at launch, GPU ms of the call, host ms from launch to its audio on the host)
    real_launch = serving._Batcher._launch

    def timed_launch(self, chunk, call):
        launched, gpu_before = time.monotonic(), self.gpu_seconds
        chunk, wait = real_launch(self, chunk, call)

        def timed_wait():
            result = wait()
            calls.append((launched, (self.gpu_seconds - gpu_before) * 1e3, (time.monotonic() - launched) * 1e3, len(chunk)))
            return result
        return chunk, timed_wait
    serving._Batcher._launch = timed_launch

    scenario_start = []  # the load's start (perf_counter), which the slow pushes' times count from
    real_record = bench_serve.Recorder.record

    def record(self, i, start, *rest):
        if not scenario_start:
            scenario_start.append(start)
        return real_record(self, i, start, *rest)
    bench_serve.Recorder.record = record
    to_monotonic = time.monotonic() - time.perf_counter()

    probe = subprocess.Popen([sys.executable, "-c", PROBE, str(cli.seconds + 3)], stdout=subprocess.PIPE, text=True)
    in_process, stop = [], threading.Event()
    thread = threading.Thread(target=sleep_probe, args=(stop, in_process), daemon=True)
    thread.start()
    steal0, switches0 = steal_ticks(), context_switches()
    raw = bench_serve.run_scenario(codec, engine, args, streams, pace, "ids", pool, sample=set())
    steal1, switches1 = steal_ticks(), context_switches()
    stop.set()
    outside = eval(probe.communicate()[0])  # noqa: S307 - our own probe's repr of a list of tuples

    slow = [(scenario_start[0] + to_monotonic + t, ms) for t, ms in zip(raw["slow"][::2], raw["slow"][1::2])]
    # stalls: slow pushes whose start lies within 50 ms of the one before
    stalls = []
    for t, ms in sorted(slow):
        if stalls and t - stalls[-1]["last"] < 0.05:
            stalls[-1].update(last=t, pushes=stalls[-1]["pushes"] + 1, worst_ms=max(stalls[-1]["worst_ms"], ms))
        else:
            stalls.append({"at": t, "last": t, "pushes": 1, "worst_ms": ms})

    def within(records, lo, hi):
        return [round(ms, 1) for t, ms in records if lo - 0.005 <= t <= hi + 0.005]

    for s in stalls:
        lo, hi = s["at"] - 0.05, s["last"] + s["worst_ms"] / 1e3
        s.update(at_s=round(s["at"] - scenario_start[0] - to_monotonic, 3), in_process_probe_ms=within(in_process, lo, hi),
                 probe_process_ms=within(outside, lo, hi),
                 long_calls=[(round(t - scenario_start[0] - to_monotonic, 3), round(g, 2), round(h, 1), n) for t, g, h, n in calls
                             if lo <= t <= hi and h > 5])
        del s["at"], s["last"]
        print(s)
    gpu_ms = sorted(g for _, g, _, _ in calls)
    summary = {
        "scenario": cli.scenario, "seconds": cli.seconds, "pushes_over_20ms": len(slow), "stalls": len(stalls),
        "p99_ms": float(torch.tensor(raw["latencies"]).quantile(0.99)),
        "in_process_late_wakeups": len(in_process), "probe_process_late_wakeups": len(outside),
        "probe_process_worst_ms": max((ms for _, ms in outside), default=0.0),
        "in_process_worst_ms": max((ms for _, ms in in_process), default=0.0),
        "engine_calls": len(calls), "call_gpu_ms_p50_p99_max": [gpu_ms[len(gpu_ms) // 2], gpu_ms[int(len(gpu_ms) * 0.99)], gpu_ms[-1]],
        "calls_over_5ms_host": sum(h > 5 for _, _, h, _ in calls),
        "steal_fraction": (steal1[0] - steal0[0]) / max(1, steal1[1] - steal0[1]),
        "context_switches": {k: switches1[k] - switches0[k] for k in switches1},
        "device": torch.cuda.get_device_name() if cli.device == "cuda" else cli.device,
    }
    print(json.dumps(summary))
    if cli.out:
        Path(cli.out).write_text(json.dumps({"summary": summary, "stall_windows": stalls,
                                             "probe_process": outside, "in_process_probe": in_process,
                                             "calls": calls}))


if __name__ == "__main__":
    main()
