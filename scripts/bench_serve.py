"""Serving under load: many streams through the batchers at a real-time pace, as a TTS server runs them.

Each scenario opens ``streams`` streams, arriving staggered over one frame's interval; each pushes one
frame (7 Orpheus ids, or the codes of one frame) per interval, the interval being one frame of audio
(85.3 ms at 24 kHz) divided by the pace (2: an LM at twice real time), on an absolute schedule (a
stream that falls behind pushes at once to catch up), for ``--seconds``; then flushes. gc stays on
(``--gc-freeze`` freezes what exists after the warm-up). Paths:

- ``ids``: ``AsyncStreamBatcher.push_ids`` (the README's path: engine calls on the event loop),
  ``ids-thread``: the same with ``engine_thread=True`` (an engine thread runs them), ``codes``:
  ``AsyncStreamBatcher.push``, ``threads``: ``StreamBatcher.push_ids`` from one thread per stream;
- ``engine``: one :class:`snac_fast.serve.EngineProcess` for the GPU, fed by ``--processes``
  front-end processes through ``EngineClient.push_ids`` (CPU cores: the front-ends' only; the engine
  process's is not counted).

It reports push-to-audio latency (the time a push takes to return its audio) p50/p99/p99.9/max over
the pushes that returned audio, pushes later than one frame of audio, the wall time against the
scenario's time (keeps pace: the last push ends within one frame of its schedule), the engine calls'
GPU span (CUDA events; an upper bound of the GPU's busy time) over the wall time, the process's CPU
time, gc pauses, the pushes over 20 ms in each second (``slow_per_s``: bursts or spread; with
``--canary``, beside it a torch-free process's late 1 ms wake-ups per second, which show a stall of
the whole host), and checks every stream's audio length and, on a sample of streams, that the audio
equals the offline decode of its codes (same seed; fp16: the fp16 rounding apart).

``--processes P`` runs the scenario in P processes at once, each with its own engine and streams/P
of the streams (how a host uses its cores: one engine per worker process); ``--gpus G`` puts
process k on GPU k % G.

    python scripts/bench_serve.py --streams 64,256,1024 --pace 2,1 --paths ids --seconds 60 --out benchmarks
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import gc
import json
import math
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import GcProbe, environment, gpu_tag, markdown_table, write_results  # noqa: E402

from snac_fast import FastSNAC  # noqa: E402
from snac_fast.configs import published_config  # noqa: E402
from snac_fast.metrics import snr_db  # noqa: E402
from snac_fast.orpheus import ORPHEUS  # noqa: E402
from snac_fast.serve import AsyncStreamBatcher, StreamBatcher  # noqa: E402

POOL = 32  # distinct code sequences; stream i plays sequence i % POOL with its own seed


def make_pool(config: dict, frames: int, seed: int = 0) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    strides = config["vq_strides"]
    return [[torch.randint(0, config["codebook_size"], (1, frames * strides[0] // s), generator=gen) for s in strides]
            for _ in range(POOL)]


class Recorder:
    """One process's raw figures of a load: latencies of the pushes that returned audio, slow
    pushes, every stream's audio length, the sampled streams' audio."""

    def __init__(self, sample: set[int]) -> None:
        self.sample, self.latencies, self.slow, self.audio_len, self.kept = sample, [], [], {}, {}

    def record(self, i: int, start: float, t0: float, t1: float, audio, pieces: list) -> int:
        """One push: its latency when it returned audio, a slow push's time, the audio of a sampled
        stream; returns its samples."""
        if len(audio):
            self.latencies.append((t1 - t0) * 1e3)
        if t1 - t0 > 0.02:
            self.slow += (t0 - start, (t1 - t0) * 1e3)  # flat floats: no tuple per push for the gc to scan
        if i in self.sample:
            pieces.append(audio)
        return len(audio)

    def finished(self, i: int, total: int, pieces: list, tail) -> None:
        self.audio_len[i] = total + len(tail)
        if i in self.sample:
            self.kept[i] = pieces + [tail]

    def raw(self, frames: int, interval: float, wall0: float, cpu0, behind: float) -> dict:
        """The figures, with the load's wall and CPU time since ``wall0``, ``cpu0``."""
        wall, cpu1 = time.perf_counter() - wall0, resource.getrusage(resource.RUSAGE_SELF)
        return {"latencies": self.latencies, "frames": frames, "interval_ms": interval * 1e3, "wall_s": wall,
                "scenario_s": frames * interval + interval, "behind_ms": behind * 1e3,
                "cpu_s": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
                "audio_len": self.audio_len, "kept": self.kept, "slow": self.slow}


# A process without torch that sleeps 1 ms at a time and prints its wake-ups later than 4 ms
# (CLOCK_MONOTONIC, ms) once its stdin closes (or after argv[1] s): late there too, a stall is the
# host's (or the virtual machine's), not ours.
HOST_PROBE = """
import select, sys, time
late, period, threshold = [], 0.001, 0.004
end = time.perf_counter() + float(sys.argv[1])
last = time.perf_counter()
while last < end and not select.select([sys.stdin], [], [], 0)[0]:
    time.sleep(period)
    now = time.perf_counter()
    if now - last > threshold:
        late.append((time.clock_gettime(time.CLOCK_MONOTONIC) - (now - last), (now - last) * 1e3))
    last = now
print(repr(late))
"""


class HostCanary:
    """``--canary``: :data:`HOST_PROBE` running beside one load (started when the load starts);
    :meth:`summary` stops it and bins its late wake-ups by second since then (as ``slow_per_s``
    bins the slow pushes). Without ``--canary`` nothing runs and the summary is empty."""

    def __init__(self, args) -> None:
        self.start = time.monotonic()
        self.process = subprocess.Popen([sys.executable, "-c", HOST_PROBE, str(3 * args.seconds + 60)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) if args.canary else None

    def summary(self) -> dict:
        if self.process is None:
            return {}
        late = ast.literal_eval(self.process.communicate("")[0])  # stdin closed: the probe stops
        at = np.asarray([t - self.start for t, _ in late], dtype=np.float64).clip(0).astype(np.int64)
        return {"canary_late_wakeups": len(late), "canary_worst_ms": max((ms for _, ms in late), default=0.0),
                "canary_late_per_s": np.bincount(at).tolist() if len(late) else []}


def run_scenario(codec, engine, args, streams: int, pace: float, path: str, pool, sample: set[int]) -> dict:
    """One load on this process's engine; returns raw latencies (ms) and counters."""
    strides = codec.config["vq_strides"]
    spf = engine.samples_per_frame
    frame_s = spf / codec.config["sampling_rate"]
    interval = frame_s / pace
    frames = int(args.seconds / interval)
    per_frame_ids = [[ORPHEUS.codes_to_ids([c[:, f * strides[0] // s:(f + 1) * strides[0] // s] for c, s in zip(codes, strides)]).tolist()
                      for f in range(frames)] for codes in pool] if path != "codes" else None
    per_frame_codes = [[[c[:, f * strides[0] // s:(f + 1) * strides[0] // s] for c, s in zip(codes, strides)]
                        for f in range(frames)] for codes in pool] if path == "codes" else None
    behind = [0.0]
    layout = ORPHEUS if path != "codes" else None
    options = dict(max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, layout=layout, output=args.output)

    recorder = Recorder(sample)
    record, finished = recorder.record, recorder.finished

    gc.collect()
    if args.gc_freeze:
        gc.freeze()
    if args.spin_gpu:  # GPU clocks up, as in a server already under load (an idle H100 sits at 345 MHz)
        x = torch.randn(4096, 4096, device=engine.device, dtype=torch.float16)
        until = time.perf_counter() + args.spin_gpu
        while time.perf_counter() < until:
            for _ in range(8):
                x @ x
            torch.cuda.synchronize()
        del x
    graphs_before = set(engine.steps.graphs)
    cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    with GcProbe() as probe:
        if path == "threads":
            batcher = StreamBatcher(engine, **options)
            start = time.perf_counter() + 0.05

            def client(i: int) -> None:
                sid = batcher.open(seed=i)
                seq = per_frame_ids[i % POOL]
                due = start + interval * i / streams
                pieces, total = [], 0
                for f in range(frames):
                    now = time.perf_counter()
                    if due > now:
                        time.sleep(due - now)
                    t0 = time.perf_counter()
                    audio = batcher.push_ids(sid, seq[f])
                    total += record(i, start, t0, time.perf_counter(), audio, pieces)
                    due += interval
                behind[0] = max(behind[0], time.perf_counter() - (due - interval))
                finished(i, total, pieces, batcher.flush(sid))
            threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(streams)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            batcher.close()
        else:
            batcher = AsyncStreamBatcher(engine, **options, engine_thread=path == "ids-thread")

            async def client(i: int, start: float) -> None:
                sid = batcher.open(seed=i)
                seq = (per_frame_codes if path == "codes" else per_frame_ids)[i % POOL]
                push = batcher.push if path == "codes" else batcher.push_ids
                pieces, total = [], [0]

                def on_audio(t0: float, t1: float, audio) -> None:
                    total[0] += record(i, start, t0, t1, audio, pieces)
                late = await paced(push, sid, seq, start + interval * i / streams, interval, on_audio)
                behind[0] = max(behind[0], late)
                finished(i, total[0], pieces, await batcher.flush(sid))

            async def main() -> None:
                start = time.perf_counter() + 0.05
                await asyncio.gather(*(client(i, start) for i in range(streams)))
                await batcher.__aexit__(None, None, None)
            run_loop(main, args.uvloop)
    if args.gc_freeze:
        gc.unfreeze()
    return {**recorder.raw(frames, interval, wall0, cpu0, behind[0]),
            "batches": batcher.batches, "requests": batcher.requests, "gpu_span_s": batcher.gpu_seconds,
            "engine_thread_s": batcher.step_seconds,
            "graphs_captured": sorted(map(str, set(engine.steps.graphs) - graphs_before)), **probe.summary()}


async def paced(push, sid: int, seq: list, due: float, interval: float, on_audio) -> float:
    """Push ``seq[f]`` to stream ``sid`` from ``due`` on, one every ``interval`` s on an absolute
    schedule (late pushes go at once); ``on_audio(t0, t1, audio)`` after each. Returns how far
    behind its schedule the last push ended (s)."""
    for item in seq:
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        t0 = time.perf_counter()
        audio = await push(sid, item)
        on_audio(t0, time.perf_counter(), audio)
        due += interval
    return time.perf_counter() - (due - interval)


def run_loop(main, use_uvloop: bool) -> None:
    if use_uvloop:
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def check_audio(codec, engine, pool, raw: dict, streams: int, output: str) -> dict:
    """Every stream's audio length; the sampled streams' audio against the offline decode."""
    spf = engine.samples_per_frame
    want_len = raw["frames"] * spf
    lengths_ok = all(n == want_len for n in raw["audio_len"].values())
    snrs = []
    for i, pieces in raw["kept"].items():
        got = torch.cat([torch.as_tensor(np.asarray(p.cpu() if isinstance(p, torch.Tensor) else p)).float() for p in pieces])
        if got.numel() != want_len:
            lengths_ok = False
            continue
        codes = [c[:, :raw["frames"] * c.shape[1] // pool[0][0].shape[1]].to(codec.device) for c in pool[i % POOL]]
        want = codec.decode(codes, seed=i)[0, 0].float().cpu()
        if output == "int16":
            want = (want * 32767).round()
        snrs.append(snr_db(want, got))
    return {"lengths_ok": lengths_ok and len(raw["audio_len"]) == streams,
            "snr_db_min": min(snrs) if snrs else None, "sampled": len(snrs)}


def summarize(raws: list[dict], frame_ms: float) -> dict:
    lat = np.concatenate([np.asarray(r["latencies"]) for r in raws])
    wall = max(r["wall_s"] for r in raws)
    return {
        "pushes": int(lat.size), "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
        "p999_ms": float(np.percentile(lat, 99.9)), "max_ms": float(lat.max()),
        "late_pushes": int((lat > frame_ms).sum()),
        "wall_s": wall, "scenario_s": raws[0]["scenario_s"], "behind_ms": max(r["behind_ms"] for r in raws),
        "keeps_pace": all(r["behind_ms"] <= frame_ms for r in raws),
        "gpu_busy_upper": sum(r["gpu_span_s"] for r in raws) / wall,
        "cpu_cores": sum(r["cpu_s"] for r in raws) / wall,
        "engine_thread_busy": sum(r["engine_thread_s"] for r in raws) / wall,
        "engine_calls": sum(r["batches"] for r in raws), "requests": sum(r["requests"] for r in raws),
        "gc_full": sum(r["gc_full"] for r in raws), "gc_max_pause_ms": max(r["gc_max_pause_ms"] for r in raws),
        "pushes_over_20ms": sum(len(r["slow"]) // 2 for r in raws),
        "graphs_captured_during_load": sorted({g for r in raws for g in r["graphs_captured"]}),
        # pushes over 20 ms in each second of the run: spread out (queueing) or in bursts (stalls)
        "slow_per_s": np.bincount(np.concatenate([np.asarray(r["slow"][::2], dtype=np.float64) for r in raws]).clip(0).astype(np.int64)
                                  ).tolist() if any(r["slow"] for r in raws) else [],
        # when the slow pushes started (s into the run) and the slowest there: where to look
        "slow_at_s": sorted({(round(t, 1), round(ms)) for r in raws for t, ms in zip(r["slow"][::2], r["slow"][1::2])},
                            key=lambda x: -x[1])[:8],
    }


def cpu_list(text: str) -> set[int]:
    """CPUs as taskset writes them: "0-1,4" -> {0, 1, 4}."""
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of a running process onto ``cpus`` (``taskset -a -p``)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def engine_front_end(args, address, streams, pace, index, ready, go, out) -> None:
    """A front-end process of the ``engine`` path: its share of the streams through one EngineClient."""
    from snac_fast.serve import EngineClient

    if args.front_cpus:
        os.sched_setaffinity(0, cpu_list(args.front_cpus))  # before any thread: they inherit it

    config = published_config(args.model)
    strides = config["vq_strides"]
    pool = make_pool(config, int(args.seconds * pace * 12) + 8)
    frame_s = math.prod(config["decoder_rates"]) * strides[0] / config["sampling_rate"]
    interval = frame_s / pace
    frames = int(args.seconds / interval)
    per_frame_ids = [[ORPHEUS.codes_to_ids([c[:, f * strides[0] // s:(f + 1) * strides[0] // s] for c, s in zip(codes, strides)]).numpy().ravel()
                      for f in range(frames)] for codes in pool]
    first = index * streams  # global stream numbers, for seeds and the audio check
    counts_engine = index < args.gpus  # front-end k feeds engine k % gpus: the first of each reports its figures
    recorder, behind = Recorder({first} if index == 0 else set()), [0.0]
    ready.put({})
    go.wait()
    gc.collect()
    cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    stats = {}
    with GcProbe() as probe:
        async def main() -> None:
            client = EngineClient(address)
            stats["before"] = await client.stats()
            start = time.perf_counter() + 0.05

            async def stream(i: int) -> None:
                sid = await client.open(seed=i)
                seq = per_frame_ids[i % POOL]
                pieces, total = [], [0]

                def on_audio(t0: float, t1: float, audio) -> None:
                    total[0] += recorder.record(i, start, t0, t1, audio, pieces)
                late = await paced(client.push_ids, sid, seq, start + interval * (i - first) / streams, interval, on_audio)
                behind[0] = max(behind[0], late)
                recorder.finished(i, total[0], pieces, await client.flush(sid))
            await asyncio.gather(*(stream(i) for i in range(first, first + streams)))
            stats.update(await client.stats())
            client.close()
        run_loop(main, args.uvloop)
    out.put({**recorder.raw(frames, interval, wall0, cpu0, behind[0]),
             # the engine process's figures over this front-end's run (counted once per engine)
             **({key: stats[name] - stats["before"][name] if counts_engine else 0
                 for key, name in [("batches", "batches"), ("gpu_span_s", "gpu_seconds"), ("engine_thread_s", "step_seconds")]}),
             "requests": 0, "graphs_captured": [], **probe.summary()})


def build(args, device):
    codec = FastSNAC.from_pretrained(f"synthetic:{args.model}", device=device)
    engine = codec.stream_engine(max_streams=args.max_streams, max_graphs=64)
    t0 = time.perf_counter()
    graphs = engine.warmup(max_batch=args.max_batch)
    return codec, engine, {"warmup_s": time.perf_counter() - t0, "graphs": graphs}


def worker_process(args, streams, pace, path, index, ready, go, out) -> None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(args.gpus)))).split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible[index % args.gpus]  # before CUDA starts in this process
    if args.switch_interval is not None:  # a spawned process starts with the default
        sys.setswitchinterval(args.switch_interval / 1e3)
    # one GPU visible: its cuda:0 (the --device of a CPU smoke run stays the CPU)
    codec, engine, warm = build(args, torch.device("cpu" if args.device == "cpu" else "cuda"))
    pool = make_pool(codec.config, int(args.seconds * pace * 12) + 8)
    ready.put(warm)
    go.wait()
    raw = run_scenario(codec, engine, args, streams, pace, path, pool, sample={0} if index == 0 else set())
    raw["check"] = check_audio(codec, engine, pool, raw, streams, args.output)
    raw.pop("kept")
    out.put(raw)


COLD_START = """
import json, sys, time
t0 = time.perf_counter()
from snac_fast import FastSNAC
codec = FastSNAC.from_pretrained("synthetic:" + sys.argv[1], device="cuda")
t1 = time.perf_counter()
phases = codec.warmup(streams=int(sys.argv[2]))
print(json.dumps({"import_and_load_s": t1 - t0, "warmup_s": time.perf_counter() - t1, **phases}))
"""


def cold_start(model: str, streams: int) -> dict:
    """``codec.warmup(streams=N)`` in a fresh process with an empty Triton cache, then again with
    that cache warm (each its own process)."""
    import subprocess
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        for label in ("empty_cache", "warm_cache"):
            done = subprocess.run([sys.executable, "-c", COLD_START, model, str(streams)], env=env,
                                  capture_output=True, text=True, check=True)
            out[label] = json.loads(done.stdout.strip().splitlines()[-1])
            out[label]["kernels_in_cache"] = sum(1 for _ in Path(cache).rglob("*.cubin"))
            print(label, out[label], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="snac_24khz")
    parser.add_argument("--streams", default="64,256")
    parser.add_argument("--pace", default="2", help="real-time factors, comma-separated (1: one frame per frame of audio)")
    parser.add_argument("--paths", default="ids", help="ids, ids-thread, codes, threads, engine (comma-separated)")
    parser.add_argument("--scenarios", default=None, help="STREAMS@PACE pairs, comma-separated (instead of --streams x --pace)")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--max-wait-ms", type=float, default=0.0)
    parser.add_argument("--max-streams", type=int, default=None, help="engine slots (default: the most streams asked)")
    parser.add_argument("--output", default="int16", choices=["tensor", "float32", "int16"])
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--gpus", type=int, default=1,
                        help="GPUs the processes are spread over (engine path: one engine process per GPU, front-end k feeds GPU k %% gpus)")
    parser.add_argument("--gc-freeze", action="store_true")
    parser.add_argument("--spin-gpu", type=float, default=0.0, metavar="S",
                        help="keep the GPU busy for S seconds right before each load (clocks up after an idle gap)")
    parser.add_argument("--switch-interval", type=float, default=None, metavar="MS",
                        help="the interpreter's GIL switch interval in ms (sys.setswitchinterval; default: leave it, 5 ms)")
    parser.add_argument("--uvloop", action="store_true", help="run the event loop on uvloop (as uvicorn does when installed)")
    parser.add_argument("--sample", type=int, default=4, help="streams whose audio is checked against offline decodes")
    parser.add_argument("--cold-start", type=int, default=0, metavar="N",
                        help="first time codec.warmup(streams=N) in fresh processes (empty, then warm Triton cache)")
    parser.add_argument("--device", default="cuda", help="where the engines run (cuda, or cpu for a smoke run): the engine path's engine process, the other paths' workers")
    parser.add_argument("--engine-cpus", default="", metavar="CPUS",
                        help="the engine path: pin the engine process (every thread) to these CPUs, e.g. 0-1")
    parser.add_argument("--front-cpus", default="", metavar="CPUS",
                        help="the engine path: pin the front-end processes to these CPUs, e.g. 2-15")
    parser.add_argument("--canary", action="store_true",
                        help="a process without torch beside each load, counting its 1 ms sleeps that woke over 4 ms late "
                             "(per second: a host-wide stall shows there too)")
    parser.add_argument("--engine-event-loop", action="store_true",
                        help="the engine path's engine process on one event loop (engine_calls='loop'), not threads")
    parser.add_argument("--out", default=None)
    parser.add_argument("--stem", default=None)
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval / 1e3)
    if args.scenarios:
        scenarios = [(int(x.split("@")[0]), float(x.split("@")[1])) for x in args.scenarios.split(",")]
    else:
        scenarios = [(int(n), float(p)) for n in args.streams.split(",") for p in args.pace.split(",")]
    sizes = [n for n, _ in scenarios]
    paths = args.paths.split(",")
    args.max_streams = args.max_streams or -(-max(sizes) // args.processes)
    device = torch.device(args.device)
    results = {"environment": environment(), "model": args.model, "args": vars(args), "rows": []}
    if args.cold_start:
        results["cold_start"] = cold_start(args.model, args.cold_start)
    config = published_config(args.model)
    frame_ms = 1e3 * math.prod(config["decoder_rates"]) * config["vq_strides"][0] / config["sampling_rate"]
    if args.processes == 1 and paths != ["engine"]:
        codec, engine, warm = build(args, device)
        results["warmup"] = warm
        print("warm-up", warm, flush=True)
    engine_processes = []
    if "engine" in paths:
        from snac_fast.serve import EngineProcess, ServeSettings

        if args.processes % args.gpus:
            parser.error("--processes must be a multiple of --gpus on the engine path")
        t0 = time.perf_counter()
        devices = [args.device] if args.gpus == 1 else [f"cuda:{g}" for g in range(args.gpus)]
        engine_processes = [EngineProcess(ServeSettings.of(model=f"synthetic:{args.model}", device=d,
                                                        max_streams=-(-max(sizes) // args.gpus), max_batch=args.max_batch,
                                                        max_wait_ms=args.max_wait_ms, shared_engine=True,
                                                        engine_calls="loop" if args.engine_event_loop else "auto"),
                                          output=args.output)
                            for d in devices]
        results["engine_process_start_s"] = time.perf_counter() - t0
        if args.engine_cpus:
            for engine_process in engine_processes:
                pin_process(engine_process.pid, cpu_list(args.engine_cpus))
        print(f"engine process up in {results['engine_process_start_s']:.1f} s", flush=True)
        if args.processes != 1 or paths == ["engine"]:  # the offline decodes the audio is checked against
            codec = FastSNAC.from_pretrained(f"synthetic:{args.model}", device=args.device)
            engine = codec.stream_engine(max_streams=1)
    for streams, pace in scenarios:
        for path in paths:
            if path == "engine":
                ctx = mp.get_context("spawn")
                ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
                share = streams // args.processes
                procs = [ctx.Process(target=engine_front_end,
                                     args=(args, engine_processes[k % args.gpus].address, share, pace, k, ready, go, out))
                         for k in range(args.processes)]
                for p in procs:
                    p.start()
                for _ in procs:
                    ready.get()
                canary = HostCanary(args)
                go.set()
                raws = [out.get() for _ in procs]
                host = canary.summary()
                for p in procs:
                    p.join()
                pool = make_pool(codec.config, int(args.seconds * pace * 12) + 8)
                merged = {"kept": {i: v for r in raws for i, v in r["kept"].items()}, "frames": raws[0]["frames"],
                          "audio_len": {i: v for r in raws for i, v in r["audio_len"].items()}}
                checks = [check_audio(codec, engine, pool, merged, share * args.processes, args.output)]
            elif args.processes == 1:
                pool = make_pool(codec.config, int(args.seconds * pace * 12) + 8)
                sample = set(range(0, streams, max(1, streams // args.sample)))
                canary = HostCanary(args)
                raw = run_scenario(codec, engine, args, streams, pace, path, pool, sample)
                host = canary.summary()
                checks = [check_audio(codec, engine, pool, raw, streams, args.output)]
                raws = [raw]
            else:
                ctx = mp.get_context("spawn")
                ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
                share = streams // args.processes
                procs = [ctx.Process(target=worker_process, args=(args, share, pace, path, k, ready, go, out))
                         for k in range(args.processes)]
                for p in procs:
                    p.start()
                warms = [ready.get() for _ in procs]
                canary = HostCanary(args)
                go.set()
                raws = [out.get() for _ in procs]
                host = canary.summary()
                for p in procs:
                    p.join()
                checks = [r.pop("check") for r in raws]
                results.setdefault("warmup_per_process", []).append(warms)
            row = {"streams": streams, "pace": pace, "path": path, "processes": args.processes, "gpus": args.gpus,
                   **summarize(raws, frame_ms),
                   "lengths_ok": all(c["lengths_ok"] for c in checks),
                   "snr_db_min": min((c["snr_db_min"] for c in checks if c["snr_db_min"] is not None), default=None),
                   **host}
            results["rows"].append(row)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    for engine_process in engine_processes:
        engine_process.close()
    results["frame_ms"] = frame_ms
    if args.out:
        stem = args.stem or f"serve_{args.model.split('_')[1]}_{_device_tag()}"
        write_results(Path(args.out), stem, results, _markdown(results))


def _device_tag() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return gpu_tag(torch.cuda.get_device_name(0))


def _markdown(r: dict) -> str:
    env, a = r["environment"], r["args"]
    lines = [f"# Serving under load, {r['model']} ({env['device']}, {env['date']})\n",
             f"`python scripts/bench_serve.py {'--scenarios ' + a['scenarios'] if a['scenarios'] else '--streams %s --pace %s' % (a['streams'], a['pace'])} --paths {a['paths']} "
             f"--seconds {a['seconds']:g} --max-batch {a['max_batch']} --output {a['output']}"
             f"{' --processes %d' % a['processes'] if a['processes'] > 1 else ''}{' --gpus %d' % a['gpus'] if a.get('gpus', 1) > 1 else ''}{' --gc-freeze' if a['gc_freeze'] else ''}{' --uvloop' if a['uvloop'] else ''}{' --switch-interval %g' % a['switch_interval'] if a.get('switch_interval') is not None else ''}{' --spin-gpu %g' % a['spin_gpu'] if a['spin_gpu'] else ''}{' --engine-event-loop' if a.get('engine_event_loop') else ''}"
             f"{' --max-wait-ms %g' % a['max_wait_ms'] if a.get('max_wait_ms') else ''}{' --engine-cpus ' + a['engine_cpus'] if a.get('engine_cpus') else ''}"
             f"{' --front-cpus ' + a['front_cpus'] if a.get('front_cpus') else ''}{' --canary' if a.get('canary') else ''}"
             f"{' --cold-start %d' % a['cold_start'] if a['cold_start'] else ''}`. "
             f"Staggered streams, one frame per push, gc {'frozen after warm-up' if a['gc_freeze'] else 'on'}; "
             f"push-to-audio latency of the pushes that returned audio; late: over one frame ({r['frame_ms']:.1f} ms).\n"]
    if "warmup" in r:
        lines.append(f"Engine warm-up: {r['warmup']['graphs']} graphs in {r['warmup']['warmup_s']:.1f} s.\n")
    if "cold_start" in r:
        c = r["cold_start"]
        lines.append(f"Cold start, `codec.warmup(streams={a['cold_start']})` in a fresh process: "
                     f"{c['empty_cache']['warmup_s']:.1f} s with an empty Triton cache (stream steps "
                     f"{c['empty_cache'].get('stream_s', 0):.1f} s), {c['warm_cache']['warmup_s']:.1f} s with a warm one "
                     f"(stream steps {c['warm_cache'].get('stream_s', 0):.1f} s).\n")
    rows = [[x["streams"], f"{x['pace']:g}x", x["path"], x["processes"], x.get("gpus", 1), f"{x['p50_ms']:.1f}", f"{x['p99_ms']:.1f}",
             f"{x['p999_ms']:.1f}", f"{x['max_ms']:.1f}", f"{x['late_pushes']} of {x['pushes']}",
             f"{x['wall_s']:.1f} / {x['scenario_s']:.1f}", "yes" if x["keeps_pace"] else f"no ({x['behind_ms']:.0f} ms)",
             f"{x['gpu_busy_upper']:.2f}", f"{x['cpu_cores']:.2f}", x["engine_calls"],
             f"{x['gc_full']} / {x['gc_max_pause_ms']:.0f}",
             "ok" if x["lengths_ok"] else "WRONG", "-" if x["snr_db_min"] is None else f"{x['snr_db_min']:.1f}"]
            for x in r["rows"]]
    lines.append(markdown_table(["streams", "pace", "path", "procs", "GPUs", "p50 ms", "p99 ms", "p99.9 ms", "max ms", "late",
                                 "wall / scenario s", "keeps pace", "GPU busy (upper)", "CPU cores", "engine calls",
                                 "gc full / longest pause ms", "lengths", "SNR vs decode dB"], rows))
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
