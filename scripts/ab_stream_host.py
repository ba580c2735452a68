"""A/B of the stream engine's host path: this tree's ``StreamEngine.step`` against an older
``snac_fast/streaming.py`` (``--against``, e.g. ``git show REV:snac_fast/streaming.py > old.py``),
both on one float16 codec with CUDA graphs, steady state (every stream started, one new frame per
step). Per step, interleaved rounds, medians: the call with sync, the host time until ``step``
returns, the GPU time between events around the call, the step graph's replay alone (GPU); then
100 steps back to back (the host's rate when the GPU keeps up), and the pieces of one graph call
(filling and uploading the inputs and launching the replay; cloning and splitting the output).

    python scripts/ab_stream_host.py --against old_streaming.py [--rounds 300]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import timed_call  # noqa: E402

from snac_fast import FastSNAC  # noqa: E402
from snac_fast import streaming  # noqa: E402


def load_engine_module(path: str):
    spec = importlib.util.spec_from_file_location("snac_fast.streaming_against", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


def pieces_of_a_graph_call(engine, streams: int, codes: list[np.ndarray]) -> dict[str, float]:
    """Host time of a graph call's two halves: filling and uploading the inputs and launching the
    replay (``graph(keys, codes)``), then cloning and splitting the output."""
    graph = engine._graphs[("step", engine._bucket(streams), 1)]
    keys = np.zeros((4, engine._bucket(streams)), np.int64)
    keys[0, :streams] = np.arange(streams)
    times: dict[str, list[float]] = {"inputs + replay launch": [], "clone + unbind": []}
    for _ in range(100):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        output = graph(keys, codes)
        t1 = time.perf_counter()
        output[:streams, 0].clone().unbind(0)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        for name, t in zip(times, (t1 - t0, t2 - t1)):
            times[name].append(t)
    return {name: median_ms(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="an older snac_fast/streaming.py")
    parser.add_argument("--model", default="snac_24khz")
    parser.add_argument("--streams", default="1,64")
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    codec = FastSNAC.from_pretrained(f"synthetic:{args.model}", device="cuda")
    strides = codec.config["vq_strides"]
    sizes = [int(s) for s in args.streams.split(",")]
    modules = {"this tree": streaming, "against": load_engine_module(args.against)}
    engines = {name: m.StreamEngine(codec.model, codec.config, max(sizes), device=codec.device, dtype=codec.dtype,
                                    cuda_graphs=True, lock=codec.lock) for name, m in modules.items()}
    gen = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, {args.model}, torch {torch.__version__}; ms, medians", flush=True)
    for S in sizes:
        runs = {}
        for name, engine in engines.items():
            slots = [engine.open(seed=i) for i in range(S)]
            total = engine.prefill_frames + args.rounds + 150
            codes = [torch.randint(0, codec.config["codebook_size"], (S, total * strides[0] // s), generator=gen)
                     for s in strides]
            steps = [[c[:, f * strides[0] // s:(f + 1) * strides[0] // s] for c, s in zip(codes, strides)]
                     for f in range(engine.prefill_frames, total)]
            engine.step(slots, [c[:, :engine.prefill_frames * strides[0] // s] for c, s in zip(codes, strides)])
            runs[name] = {"engine": engine, "slots": slots, "steps": iter(steps), "call": [], "host": [], "gpu": []}
            for _ in range(5):
                engine.step(slots, next(runs[name]["steps"]))
        for _ in range(args.rounds):
            for run in runs.values():
                step = next(run["steps"])
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                run["engine"].step(run["slots"], step)
                t1 = time.perf_counter()
                end.record()
                torch.cuda.synchronize()
                run["call"].append(time.perf_counter() - t0)
                run["host"].append(t1 - t0)
                run["gpu"].append(start.elapsed_time(end) / 1e3)
        replays = {name: [] for name in runs}  # the graph alone, GPU time (repeats the last step's inputs)
        for _ in range(args.rounds):
            for name, run in runs.items():
                graph = run["engine"]._graphs[("step", run["engine"]._bucket(S), 1)].graph
                replays[name].append(timed_call(graph.replay)[1] / 1e3)
        for name, run in runs.items():
            engine, slots = run["engine"], run["slots"]
            for s in slots:  # the replays above repeated a step: start these streams afresh
                engine.close(s)
            slots = [engine.open(seed=i) for i in range(S)]
            first = next(run["steps"])
            engine.step(slots, [c.repeat(1, engine.prefill_frames) for c in first])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(100):
                engine.step(slots, next(run["steps"]))
            host_rate = (time.perf_counter() - t0) * 10
            torch.cuda.synchronize()
            with_gpu = (time.perf_counter() - t0) * 10
            pieces = pieces_of_a_graph_call(engine, S, [c.numpy() for c in next(run["steps"])])
            for s in slots:
                engine.close(s)
            print(f"{S:3d} streams, {name:9s}: call {median_ms(run['call']):.3f} | host until return "
                  f"{median_ms(run['host']):.3f} | GPU {median_ms(run['gpu']):.3f} | replay alone, GPU "
                  f"{median_ms(replays[name]):.3f} | back to back: host "
                  f"{host_rate:.3f}/step, with GPU {with_gpu:.3f}/step | "
                  + " | ".join(f"{k} {v:.3f}" for k, v in pieces.items()), flush=True)


if __name__ == "__main__":
    main()
