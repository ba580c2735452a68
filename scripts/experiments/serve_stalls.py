"""Where a serving load's slow pushes come from (GPU): one in-process load of ``bench_serve.py``
(``AsyncStreamBatcher.push_ids``) with three probes running beside it, to tell a stall of the
process from one of the host or of the GPU:

- a thread of this process that sleeps 1 ms at a time and records each wake-up later than 4 ms
  (it needs the GIL to record: a stall of this process's interpreter shows here), and at each
  wake-up samples the engine thread from ``/proc`` (on-CPU and run-queue time, faults, its system
  call now), the event loop thread's system call and, every 10th, the GPU's interrupt count;
- a separate probe process without torch doing the same (a stall of the whole host, or of the
  virtual machine, shows there too);
- every engine call's GPU span (CUDA events, the batcher's own) with its host time, and the host's
  ``/proc/stat`` steal time, its memory-compaction counters (``/proc/vmstat``) and this process's
  context switches over the load.

Prints, per stall of the slow pushes (a cluster of pushes over 20 ms), what each probe saw in the
same window (engine calls over 5 ms: seconds into the load, GPU ms, host ms to audio, rows, host ms
of the launch's parts (the step graph's replay, its wait for its inputs' last upload, the whole
``step_rows``, the PCM conversion and copy), of the whole launch, of the wait for the copy; the
engine thread's samples), and writes the raw records as JSON. Options run loops without the
batcher first: bare CUDA or CUDA-graph loops, the engine's steps alone or beside a busy thread,
back-to-back step-graph replays timed on the GPU. The load runs through the default
``AsyncStreamBatcher`` (engine calls on the event loop's thread); ``--engine-thread`` through one
made with ``engine_thread=True`` (the batcher before 2026-11-28).

    python scripts/experiments/serve_stalls.py --scenario 64@2 --seconds 20 --out /tmp/stalls.json
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_serve  # noqa: E402

from snac_fast import serving  # noqa: E402
from snac_fast.streaming.engine import STEP, StreamEngine  # noqa: E402
from snac_fast.streaming.step_graph import StepGraph  # noqa: E402


def bare_cuda_loop(seconds: float, copy: bool = False, events: bool = False, churn: int = 0) -> dict:
    """A loop of one tiny kernel and a synchronize, nothing of this package: whether the platform's
    CUDA submissions stall by themselves (iterations over 5 ms, and when). ``copy``: each iteration
    also copies 16 K int16 to pinned host memory and waits for that copy's event, as the batcher does;
    ``events``: with two new timing events each iteration (its start, the copy's end), as the
    batcher makes per engine call; ``churn``: each iteration also allocates, fills and frees that
    many bytes of host memory (numpy), as the batcher's copy of each call's PCM out of pinned memory
    does."""
    x = torch.zeros(16384, device="cuda", dtype=torch.int16)
    host = torch.empty(16384, dtype=torch.int16, pin_memory=True)
    steady_event = torch.cuda.Event()
    torch.cuda.synchronize()

    def iteration() -> None:
        if churn:
            np.ones(churn, np.uint8).copy()
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
    return {"copy": copy, "events": events, "churn_bytes": churn, **_slow_iterations(iteration, seconds)}


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


def bare_engine_loop(engine, seconds: float, contend: bool = False, streams: int = 64, seed: int = 0) -> dict:
    """The batcher's engine work without the batcher: one thread steps a random number (1 to
    ``streams``) of open streams one frame each (``step_rows``), converts the audio to int16, copies
    it to pinned memory and waits for the copy, in a loop. ``contend``: the loop runs in a second
    thread while this one alternates 0.2 ms of Python with 0.5 ms asleep (an event loop's rhythm
    under load), so the two share the GIL as in serving."""
    rng = np.random.default_rng(seed)
    streams = min(streams, engine.max_streams)
    slots = [engine.open(seed=i) for i in range(streams)]
    width = sum(engine._ratios)
    cuda = engine.device.type == "cuda"
    host = torch.empty(streams * engine.samples_per_frame * 16, dtype=torch.int16, pin_memory=cuda)  # the first steps emit more
    done = torch.cuda.Event() if cuda else None

    def iteration() -> None:
        n = int(rng.integers(1, streams + 1))
        rows = rng.integers(0, engine.config["codebook_size"], (n, width))
        audio, offsets = engine.step_rows(slots[:n], rows, 1)
        pcm = serving.int16_pcm(audio)
        host[:pcm.numel()].copy_(pcm, non_blocking=cuda)
        if cuda:
            done.record()
            done.synchronize()
        host.numpy()[:offsets[-1]].copy()
    result = {}
    if contend:
        stop = threading.Event()
        worker = threading.Thread(target=lambda: result.update(_slow_iterations(iteration, seconds)) or stop.set())
        worker.start()
        while not stop.is_set():  # ~0.2 ms of Python, then 0.5 ms asleep: an event loop's rhythm under load
            busy_until = time.perf_counter() + 0.0002
            while time.perf_counter() < busy_until:
                [i * 2 for i in range(50)]
            time.sleep(0.0005)
        worker.join()
    else:
        result = _slow_iterations(iteration, seconds)
    for slot in slots:
        engine.close(slot)
    return {"contend": contend, "streams": streams, **result}


def gpu_chunks(engine, seconds: float, batch: int = 64, chunk: int = 100) -> dict:
    """Whether the GPU or the host slows in a stall: the one-frame step graph of ``batch`` rows
    replayed ``chunk`` times back to back with a CUDA event pair around each replay (the host runs
    ahead, so each pair times the GPU's work alone) and the host's time for each launch, chunk after
    chunk for ``seconds``. Returns the replays whose GPU time exceeds twice the median and the
    launches over 2 ms (seconds into the run, ms)."""
    batch = max(b for kind, b, frames in engine._graphs if kind == STEP and frames == 1 and b <= batch)
    graph = engine._graphs[(STEP, batch, 1)]
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(chunk)]
    gpu, host, start = [], [], time.perf_counter()
    while time.perf_counter() - start < seconds:
        launched = []
        for begun, ended in events:
            t = time.perf_counter()
            begun.record()
            graph.launch()
            ended.record()
            launched.append((t - start, (time.perf_counter() - t) * 1e3))
        torch.cuda.synchronize()
        gpu += [(t, begun.elapsed_time(ended)) for (t, _), (begun, ended) in zip(launched, events)]
        host += launched
    median = sorted(ms for _, ms in gpu)[len(gpu) // 2]
    slow_gpu = [(round(t, 3), round(ms, 2)) for t, ms in gpu if ms > 2 * median]
    slow_host = [(round(t, 3), round(ms, 2)) for t, ms in host if ms > 2.0]
    return {"batch": batch, "replays": len(gpu), "gpu_ms_median": round(median, 3),
            "gpu_ms_max": round(max(ms for _, ms in gpu), 2), "gpu_over_2x_median": len(slow_gpu),
            "host_launch_ms_median": round(sorted(ms for _, ms in host)[len(host) // 2], 3),
            "host_launch_over_2ms": len(slow_host), "slow_gpu": slow_gpu[:60], "slow_host": slow_host[:60]}


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


def window_usage(samples: list, lo: float, hi: float) -> dict | None:
    """The engine thread over [lo, hi] s (monotonic): the fraction of it on a CPU, waiting in the run
    queue, its user and system ticks (10 ms each), its minor faults, the process's, and the states seen."""
    inside = [s for s in samples if lo <= s[0] <= hi]
    if len(inside) < 2:
        return None
    first, last = inside[0], inside[-1]
    span_ns = (last[0] - first[0]) * 1e9
    return {"ms": round(span_ns / 1e6, 1), "on_cpu": round((last[1] - first[1]) / span_ns, 3),
            "run_queue": round((last[2] - first[2]) / span_ns, 3), "user_ticks": last[4] - first[4],
            "system_ticks": last[5] - first[5], "thread_faults": last[3] - first[3],
            "process_faults": last[8] - first[8], "states": "".join(sorted({s[6] for s in inside})),
            "engine_syscalls": _shares([s[7] for s in inside]), "main_syscalls": _shares([s[9] for s in inside]),
            "gpu_interrupts_per_s": _rate([(s[0], s[10]) for s in inside if s[10] is not None])}


def _rate(counts: list[tuple[float, int]]) -> float | None:
    """Events per second over (monotonic s, count so far) samples."""
    if len(counts) < 2 or counts[-1][0] <= counts[0][0]:
        return None
    return round((counts[-1][1] - counts[0][1]) / (counts[-1][0] - counts[0][0]), 1)


def _shares(names: list[str]) -> dict:
    """The share of samples in each system call, largest first."""
    return {k: round(v / len(names), 2) for k, v in collections.Counter(names).most_common()}


def _percentiles(values: list[float]) -> list[float]:
    values = sorted(values)
    return [round(values[len(values) // 2], 3), round(values[int(len(values) * 0.99)], 3), round(values[-1], 3)]


def set_sync_schedule(name: str) -> None:
    """How this process's CUDA context waits for the GPU (the driver's CU_CTX_SCHED_* flag on the
    primary context, set before torch starts it): "spin" polls, "yield" polls and yields the CPU,
    "blocking" sleeps until the GPU interrupts; "auto" (the default) spins while the host has more
    cores than contexts."""
    import ctypes
    flags = {"auto": 0, "spin": 1, "yield": 2, "blocking": 4}[name]
    cuda = ctypes.CDLL("libcuda.so.1")
    device = ctypes.c_int()
    for result in (cuda.cuInit(0), cuda.cuDeviceGet(ctypes.byref(device), 0),
                   cuda.cuDevicePrimaryCtxSetFlags(device, flags)):
        if result != 0:
            raise RuntimeError(f"CUDA driver error {result} setting the sync schedule {name!r}")


def thread_sample(tid: int) -> tuple:
    """One thread's (on-CPU ns, run-queue wait ns, minor faults, user ticks, system ticks, state,
    system call now) from /proc: on the CPU through a stall means it spun or ran the kernel; off
    it, it waited (the system call says on what: a futex is the GIL or a lock)."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        on_cpu, waited = (int(x) for x in f.read().split()[:2])
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return on_cpu, waited, int(fields[7]), int(fields[11]), int(fields[12]), fields[0], current_syscall(tid)


SYSCALLS = {"0": "read", "1": "write", "7": "poll", "16": "ioctl", "24": "sched_yield", "35": "nanosleep",
            "202": "futex", "230": "clock_nanosleep", "232": "epoll_wait", "281": "epoll_pwait", "running": "running"}


def current_syscall(tid: int) -> str:
    """The system call a thread is in now (x86-64 names for the usual ones), or "running"."""
    with open(f"/proc/self/task/{tid}/syscall") as f:
        number = f.read().split()[0]
    return SYSCALLS.get(number, number)


def sleep_probe(stop: threading.Event, late: list, samples: list, engine_thread: str = "snac-fast-batcher") -> None:
    """Wakes every 1 ms: records late wake-ups, and appends to ``samples`` (monotonic s, then
    :func:`thread_sample`'s fields of ``engine_thread``, this process's minor page faults, the main
    thread's system call, and every 10th sample the GPU's interrupt count, else None)."""
    last = time.perf_counter()
    engine_tid, main_tid = None, threading.main_thread().native_id
    while not stop.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        if now - last > 0.004:
            late.append((time.monotonic() - (now - last), (now - last) * 1e3))
        last = now
        if engine_tid is None:
            engine_tid = next((t.native_id for t in threading.enumerate() if t.name == engine_thread), None)
            continue
        try:
            samples.append((time.monotonic(), *thread_sample(engine_tid),
                            resource.getrusage(resource.RUSAGE_SELF).ru_minflt, current_syscall(main_tid),
                            gpu_interrupts() if len(samples) % 10 == 0 else None))
        except OSError:  # the engine thread ended
            engine_tid = None


def gpu_interrupts() -> int:
    """The NVIDIA driver's interrupts so far, all CPUs (/proc/interrupts): a virtualized GPU whose
    interrupts come late or in bursts has been reported to slow CUDA calls on some hosts only."""
    total = 0
    with open("/proc/interrupts") as f:
        for line in f:
            if "nvidia" in line:
                total += sum(int(x) for x in line.split()[1:] if x.isdigit())
    return total


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
    parser.add_argument("--bare-engine-loop", type=float, default=0.0, metavar="S",
                        help="after the warm-up, run the engine's steps and copies without the batcher for S seconds, "
                             "alone and then beside a busy Python thread, and print their stalls")
    parser.add_argument("--gpu-chunks", type=float, default=0.0, metavar="S",
                        help="after the warm-up, replay the 64-row step graph in chunks of 100 with events around each "
                             "for S seconds: GPU time per replay against host time per launch")
    parser.add_argument("--sync", default="auto", choices=["auto", "spin", "yield", "blocking"],
                        help="how the CUDA context waits for the GPU (set before torch starts it)")
    parser.add_argument("--cpus", default="", help="pin the process (every thread made after) to these CPUs, e.g. 2,3,4,5")
    parser.add_argument("--engine-thread", action="store_true",
                        help="run the load through AsyncStreamBatcher(engine_thread=True): the engine calls on a thread of their own")
    parser.add_argument("--copy", action="store_true", help="the bare loop also copies to pinned memory")
    parser.add_argument("--events", action="store_true", help="the bare loop makes two timing events each iteration")
    parser.add_argument("--churn", type=int, default=0, metavar="BYTES",
                        help="the bare loop also allocates, fills and frees BYTES of host memory each iteration")
    parser.add_argument("--output", default="int16", choices=["tensor", "float32", "int16"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    cli = parser.parse_args()
    if cli.switch_interval is not None:
        sys.setswitchinterval(cli.switch_interval / 1e3)
    if cli.sync != "auto":
        set_sync_schedule(cli.sync)
    if cli.cpus:
        os.sched_setaffinity(0, {int(c) for c in cli.cpus.split(",")})  # threads made from here on inherit it
    if cli.bare_cuda_loop:
        print(json.dumps({"bare_cuda_loop": bare_cuda_loop(cli.bare_cuda_loop, cli.copy, cli.events, cli.churn)}), flush=True)
    if cli.bare_graph_loop:
        print(json.dumps({"bare_graph_loop": bare_graph_loop(cli.bare_graph_loop)}), flush=True)
    streams, pace = int(cli.scenario.split("@")[0]), float(cli.scenario.split("@")[1])
    args = argparse.Namespace(model="snac_24khz", seconds=cli.seconds, max_batch=cli.max_batch, max_wait_ms=0.0,
                              max_streams=streams, output=cli.output, gc_freeze=False, spin_gpu=0.0, uvloop=False)
    codec, engine, _ = bench_serve.build(args, torch.device(cli.device))
    if cli.gpu_chunks:
        print(json.dumps({"gpu_chunks": gpu_chunks(engine, cli.gpu_chunks)}), flush=True)
    for contend in [False, True][:2 if cli.bare_engine_loop else 0]:
        print(json.dumps({"bare_engine_loop": bare_engine_loop(engine, cli.bare_engine_loop, contend)}), flush=True)
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
        chunk, wait, ready = real_launch(self, chunk, call)
        launch_ms, replayed = (time.monotonic() - launched) * 1e3, dict(parts)

        def timed_wait():
            t = time.monotonic()
            result = wait()
            now = time.monotonic()
            calls.append((launched, (self.gpu_seconds - gpu_before) * 1e3, (now - launched) * 1e3, len(chunk),
                          replayed, launch_ms, (now - t) * 1e3))
            return result
        return chunk, timed_wait, ready
    serving._Batcher._launch = timed_launch

    scenario_start = []  # the load's start (perf_counter), which the slow pushes' times count from
    real_record = bench_serve.Recorder.record

    def record(self, i, start, *rest):
        if not scenario_start:
            scenario_start.append(start)
        return real_record(self, i, start, *rest)
    bench_serve.Recorder.record = record
    to_monotonic = time.monotonic() - time.perf_counter()

    probe = subprocess.Popen([sys.executable, "-c", bench_serve.HOST_PROBE, str(cli.seconds + 3)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    in_process, samples, stop = [], [], threading.Event()
    # the thread that runs the engine calls: the event loop's (this one), or the batcher's own
    engine_thread = "snac-fast-batcher" if cli.engine_thread else "MainThread"
    thread = threading.Thread(target=sleep_probe, args=(stop, in_process, samples, engine_thread), daemon=True)
    thread.start()
    steal0, switches0, vm0 = steal_ticks(), context_switches(), vmstat()
    raw = bench_serve.run_scenario(codec, engine, args, streams, pace, "ids-thread" if cli.engine_thread else "ids",
                                   pool, sample=set())
    steal1, switches1, vm1 = steal_ticks(), context_switches(), vmstat()
    stop.set()
    outside = ast.literal_eval(probe.communicate("")[0])  # stdin closed: the probe stops

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
                 engine_thread=window_usage(samples, lo, hi),
                 probe_process_ms=within(outside, lo, hi),
                 long_calls=[(round(t - scenario_start[0] - to_monotonic, 3), round(g, 2), round(h, 1), n,
                              {k: round(v, 2) for k, v in r.items()}, round(lm, 2), round(w, 2))
                             for t, g, h, n, r, lm, w in calls if lo <= t <= hi and h > 5])
        del s["at"], s["last"]
        print(s)
    gpu_ms = sorted(c[1] for c in calls)
    summary = {
        "scenario": cli.scenario, "seconds": cli.seconds, "output": cli.output, "switch_interval_ms": sys.getswitchinterval() * 1e3, "sync": cli.sync, "cpus": cli.cpus, "engine_thread_option": cli.engine_thread, "pushes_over_20ms": len(slow), "stalls": len(stalls),
        "p99_ms": float(torch.tensor(raw["latencies"]).quantile(0.99)),
        "in_process_late_wakeups": len(in_process), "probe_process_late_wakeups": len(outside),
        "probe_process_worst_ms": max((ms for _, ms in outside), default=0.0),
        "in_process_worst_ms": max((ms for _, ms in in_process), default=0.0),
        "engine_thread": window_usage(samples, samples[0][0], samples[-1][0]) if samples else None,
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
                                             "calls": calls, "engine_thread_samples": samples}))


if __name__ == "__main__":
    main()
