"""Shared benchmark plumbing: CUDA-event timing (median, warm-up, rotated inputs), environment, output."""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch


def median_ms(fn: Callable[..., object], input_sets: Sequence[tuple], replays: int = 50, warmup: int = 3) -> float:
    """Median GPU time of one ``fn(*inputs)`` call in ms.

    The calls (one per input set, so consecutive calls touch different buffers) are captured in a
    CUDA graph and its replays are timed with CUDA events: this measures the GPU's work, not
    Python's launch overhead, which a decode in graph mode does not pay either.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture stream: compiles, autotunes, allocates
        for _ in range(warmup):
            for inputs in input_sets:
                fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for inputs in input_sets:
            fn(*inputs)
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(input_sets))
    return statistics.median(times)


def environment() -> dict:
    import triton

    cuda = torch.cuda.is_available()  # a CPU smoke run of a harness records the CPU
    return {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        # portable mode (another card's launch rules, no TMA, no dependent launch): what was measured
        "gpu_limits": os.environ.get("SNAC_FAST_GPU_LIMITS") or None,
    }


def gpu_tag(name: str) -> str:
    """The report-name suffix of a device name: ``h100``, ``h200``, else the name in lower case."""
    return "h200" if "H200" in name else "h100" if "H100" in name else name.lower().replace(" ", "_")


def write_results(out_dir: Path, stem: str, payload: dict, markdown: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown)
    print(f"wrote {out_dir / stem}.json and .md")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def timed_call(fn: Callable[..., object], *args) -> tuple[float, float]:
    """(wall ms with a synchronize, GPU ms between CUDA events recorded around the call) of ``fn(*args)``
    under inference mode."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    with torch.inference_mode():
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, start.elapsed_time(end)


def interleaved_decodes(codecs: dict, work: dict, rounds: int, calls: int = 5) -> dict:
    """{(mode, label): (median per-call ms with sync, median GPU ms)} of ``codecs[mode].decode(
    work[label], seed=0)``: each round runs every workload in every mode, the modes' order reversed
    every other round, one untimed call before each mode's ``calls`` timed ones."""
    times = {(m, w): [] for m in codecs for w in work}
    for r in range(rounds):
        for label, codes in work.items():
            for mode in list(codecs)[::1 if r % 2 == 0 else -1]:
                run = lambda: codecs[mode].decode(codes, seed=0)  # noqa: E731
                run()
                times[(mode, label)] += [timed_call(run) for _ in range(calls)]
    return {key: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)) for key, ts in times.items()}


class GcProbe:
    """gc pauses during a load (gc.callbacks): count, longest, full (generation 2) collections."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._start = 0.0

    def _on_gc(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], (time.perf_counter() - self._start) * 1e3))

    def __enter__(self):
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._on_gc)

    def summary(self) -> dict:
        full = [ms for g, ms in self.pauses if g == 2]
        return {"gc_pauses": len(self.pauses), "gc_max_pause_ms": max((ms for _, ms in self.pauses), default=0.0),
                "gc_full": len(full), "gc_full_max_ms": max(full, default=0.0)}


class MachineLoad:
    """What the machine did during a run: each GPU's busy fraction (nvidia-smi's utilization, the
    share of sample periods with a kernel running, sampled every 200 ms) and the host's busy cores
    (/proc/stat). Either part is empty where its source is missing."""

    def __enter__(self):
        import shutil
        import subprocess

        self._cpu = self._cpu_times()
        self._smi = None
        if shutil.which("nvidia-smi"):
            self._smi = subprocess.Popen(["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits",
                                          "-lms", "200"], stdout=subprocess.PIPE, text=True)
        return self

    @staticmethod
    def _cpu_times() -> tuple[float, float] | None:
        try:
            fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except OSError:
            return None
        return fields[3] + fields[4], sum(fields)  # idle + iowait, all (in jiffies)

    def __exit__(self, *exc):
        self.cores = None
        end = self._cpu_times()
        if self._cpu and end:
            idle, total = end[0] - self._cpu[0], end[1] - self._cpu[1]
            self.cores = (1 - idle / total) * (os.cpu_count() or 1) if total else None
        self.gpu_busy: dict[int, float] = {}
        if self._smi is not None:
            self._smi.terminate()
            out, _ = self._smi.communicate()
            samples: dict[int, list[float]] = {}
            for line in out.splitlines():
                try:
                    index, busy = (int(v) for v in line.split(","))
                except ValueError:
                    continue
                samples.setdefault(index, []).append(busy / 100)
            self.gpu_busy = {k: statistics.fmean(v) for k, v in samples.items()}

    def summary(self) -> dict:
        return {"host_cores_busy": self.cores, "gpu_busy": self.gpu_busy}
