"""Where a serving load's slow pushes come from (GPU): one in-process load of ``bench_serve.py``
(``AsyncStreamBatcher.push_ids``) with three probes running beside it, to tell a stall of the
process from one of the host or of the GPU:

- a thread of this process that sleeps 1 ms at a time and records each wake-up later than 4 ms
  (it needs the GIL to record: a stall of this process's interpreter shows here);
- a separate probe process without torch doing the same (a stall of the whole host, or of the
  virtual machine, shows there too);
- every engine call's GPU span (CUDA events, the batcher's own) with its host time, and the host's
  ``/proc/stat`` steal time, its memory-compaction counters (``/proc/vmstat``) and this process's
  context switches over the load.

Prints, per stall of the slow pushes (a cluster of pushes over 20 ms), what each probe saw in the
same window (engine calls over 5 ms: seconds into the load, GPU ms, host ms to audio, rows, host ms
of the launch's parts (the step graph's replay, its wait for its inputs' last upload, the whole
``step_rows``, the PCM conversion and copy), of the whole launch, of the wait for the copy), and
writes the raw records as JSON.

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
from snac_fast.streaming.engine import StreamEngine  # noqa: E402
from snac_fast.streaming.step_graph import StepGraph  # noqa: E402

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


def bare_cuda_loop(seconds: float, copy: bool = False, events: bool = False) -> dict:
    """A loop of one tiny kernel and a synchronize, nothing of this package: whether the platform's
    CUDA submissions stall by themselves (iterations over 5 ms, and when). ``copy``: each iteration
    also copies 16 K int16 to pinned host memory and waits for that copy's event, as the batcher does;
    ``events``: with two new timing events each iteration (its start, the copy's end), as the
    batcher makes per engine call."""
    x = torch.zeros(16384, device="cuda", dtype=torch.int16)
    host = torch.empty(16384, dtype=torch.int16, pin_memory=True)
    steady_event = torch.cuda.Event()
    torch.cuda.synchronize()

    def iteration() -> None:
        if events:
            begun, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begun.record()
        else:
            done = steady_event
        x.add_(1)
        if copy:
            host.copy_(x, non_blocking=True)
            done.record()
            done.synchronize()
            if events:
                begun.elapsed_time(done)
        else:
            torch.cuda.synchronize()
    return {"copy": copy, "events": events, **_slow_iterations(iteration, seconds)}


def bare_graph_loop(seconds: float, kernels: int = 40) -> dict:
    """A CUDA graph of ``kernels`` small kernels replayed and synchronized in a loop, nothing of this
    package: whether graph replays stall by themselves on the platform."""
    x = torch.zeros(64, 2048, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(kernels):
            x.add_(1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            x.add_(1)
    torch.cuda.synchronize()

    def iteration() -> None:
        graph.replay()
        torch.cuda.synchronize()
    return {"kernels": kernels, **_slow_iterations(iteration, seconds)}


def _slow_iterations(iteration, seconds: float) -> dict:
    """Run ``iteration()`` for ``seconds``: how many ran, those over 5 ms (when, how long)."""
    slow, iterations, start = [], 0, time.perf_counter()
    last = start
    while last - start < seconds:
        iteration()
        now = time.perf_counter()
        if now - last > 0.005:
            slow.append((round(last - start, 3), round((now - last) * 1e3, 1)))
        last, iterations = now, iterations + 1
    return {"seconds": seconds, "iterations": iterations, "over_5ms": len(slow),
            "worst_ms": max((ms for _, ms in slow), default=0.0), "slow_at_s": slow[:40]}


def _percentiles(values: list[float]) -> list[float]:
    values = sorted(values)
    return [round(values[len(values) // 2], 3), round(values[int(len(values) * 0.99)], 3), round(values[-1], 3)]


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


def vmstat() -> dict:
    """The host's memory-compaction and huge-page counters (/proc/vmstat): a direct compaction
    stalls the faulting thread for milliseconds."""
    with open("/proc/vmstat") as f:
        return {k: int(v) for k, v in (line.split() for line in f)
                if k.startswith(("compact_stall", "compact_fail", "thp_fault", "pgmajfault", "allocstall"))}


def context_switches() -> dict:
    with open("/proc/self/status") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f if "ctxt_switches" in line)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="64@2")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--switch-interval", type=float, default=None, metavar="MS",
                        help="the interpreter's GIL switch interval in ms (default: leave it, 5 ms)")
    parser.add_argument("--bare-cuda-loop", type=float, default=0.0, metavar="S",
                        help="first run a bare CUDA loop (one tiny kernel and a synchronize) for S seconds and print its stalls")
    parser.add_argument("--bare-graph-loop", type=float, default=0.0, metavar="S",
                        help="first replay a bare CUDA graph of 40 small kernels in a loop for S seconds and print its stalls")
    parser.add_argument("--copy", action="store_true", help="the bare loop also copies to pinned memory")
    parser.add_argument("--events", action="store_true", help="the bare loop makes two timing events each iteration")
    parser.add_argument("--output", default="int16", choices=["tensor", "float32", "int16"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    cli = parser.parse_args()
    if cli.switch_interval is not None:
        sys.setswitchinterval(cli.switch_interval / 1e3)
    if cli.bare_cuda_loop:
        print(json.dumps({"bare_cuda_loop": bare_cuda_loop(cli.bare_cuda_loop, cli.copy, cli.events)}), flush=True)
    if cli.bare_graph_loop:
        print(json.dumps({"bare_graph_loop": bare_graph_loop(cli.bare_graph_loop)}), flush=True)
    streams, pace = int(cli.scenario.split("@")[0]), float(cli.scenario.split("@")[1])
    args = argparse.Namespace(model="snac_24khz", seconds=cli.seconds, max_batch=cli.max_batch, max_wait_ms=0.0,
                              max_streams=streams, output=cli.output, gc_freeze=False, spin_gpu=0.0, uvloop=False)
    codec, engine, _ = bench_serve.build(args, torch.device(cli.device))
    pool = bench_serve.make_pool(codec.config, int(cli.seconds * pace * 12) + 8)

    # per engine call: host monotonic at launch, GPU ms of the call (CUDA events), host ms from launch
    # to its audio on the host, rows, and the host ms of its parts: the graph replay's launch, the
    # whole launch (inputs, replay, PCM conversion, copy), the wait for the copy
    calls = []
    real_launch = serving._Batcher._launch
    parts = {"replay": 0.0, "inputs_wait": 0.0, "step_rows": 0.0, "to_host": 0.0}  # host ms of the call's parts

    def timed(owner, name: str, part: str) -> None:
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                parts[part] += (time.perf_counter() - t) * 1e3
        setattr(owner, name, wrapper)
    timed(StepGraph, "launch", "replay")
    timed(StepGraph, "inputs", "inputs_wait")
    timed(StreamEngine, "step_rows", "step_rows")
    timed(serving._Batcher, "_to_host", "to_host")

    def timed_launch(self, chunk, call):
        for part in parts:
            parts[part] = 0.0
        launched, gpu_before = time.monotonic(), self.gpu_seconds
        chunk, wait = real_launch(self, chunk, call)
        launch_ms, replayed = (time.monotonic() - launched) * 1e3, dict(parts)

        def timed_wait():
            t = time.monotonic()
            result = wait()
            now = time.monotonic()
            calls.append((launched, (self.gpu_seconds - gpu_before) * 1e3, (now - launched) * 1e3, len(chunk),
                          replayed, launch_ms, (now - t) * 1e3))
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
    steal0, switches0, vm0 = steal_ticks(), context_switches(), vmstat()
    raw = bench_serve.run_scenario(codec, engine, args, streams, pace, "ids", pool, sample=set())
    steal1, switches1, vm1 = steal_ticks(), context_switches(), vmstat()
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
                 long_calls=[(round(t - scenario_start[0] - to_monotonic, 3), round(g, 2), round(h, 1), n,
                              {k: round(v, 2) for k, v in r.items()}, round(lm, 2), round(w, 2))
                             for t, g, h, n, r, lm, w in calls if lo <= t <= hi and h > 5])
        del s["at"], s["last"]
        print(s)
    gpu_ms = sorted(c[1] for c in calls)
    summary = {
        "scenario": cli.scenario, "seconds": cli.seconds, "output": cli.output, "switch_interval_ms": sys.getswitchinterval() * 1e3, "pushes_over_20ms": len(slow), "stalls": len(stalls),
        "p99_ms": float(torch.tensor(raw["latencies"]).quantile(0.99)),
        "in_process_late_wakeups": len(in_process), "probe_process_late_wakeups": len(outside),
        "probe_process_worst_ms": max((ms for _, ms in outside), default=0.0),
        "in_process_worst_ms": max((ms for _, ms in in_process), default=0.0),
        "engine_calls": len(calls), "call_gpu_ms_p50_p99_max": [gpu_ms[len(gpu_ms) // 2], gpu_ms[int(len(gpu_ms) * 0.99)], gpu_ms[-1]],
        "calls_over_5ms_host": sum(c[2] > 5 for c in calls),
        **{f"{part}_ms_p50_p99_max": _percentiles([c[4][part] for c in calls]) for part in parts},
        "call_launch_ms_p50_p99_max": _percentiles([c[5] for c in calls]),
        "steal_fraction": (steal1[0] - steal0[0]) / max(1, steal1[1] - steal0[1]),
        "context_switches": {k: switches1[k] - switches0[k] for k in switches1},
        "vmstat": {k: vm1[k] - vm0.get(k, 0) for k in vm1},
        "device": torch.cuda.get_device_name() if cli.device == "cuda" else cli.device,
        # the load's start on the wall clock, to line stalls up with outside logs (nvidia-smi)
        "start_unix_s": time.time() - (time.perf_counter() - scenario_start[0]),
    }
    print(json.dumps(summary))
    if cli.out:
        Path(cli.out).write_text(json.dumps({"summary": summary, "stall_windows": stalls,
                                             "probe_process": outside, "in_process_probe": in_process,
                                             "calls": calls}))


if __name__ == "__main__":
    main()
