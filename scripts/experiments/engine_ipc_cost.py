"""Host cost of feeding one engine process from front-end processes, the decoder left out: could
one process hold the pushes of thousands of real-time streams if HTTP ran elsewhere? (#41: one
process per engine is bound by the GIL; one engine per worker process time-slices the GPU.)

Front-end processes hold ``--streams`` streams in all, each pushing one frame's level-major codes
(7 int64) every 85.3 ms (24 kHz real time, staggered); a front-end gathers what its streams push
in one tick (``--tick-ms``) into one message of three arrays (stream ids, frames, codes) sent over a
Unix socket (``multiprocessing.connection``). The engine process's reader thread takes messages,
its engine thread answers each round at once with int16 silence per push (one message per
front-end per round: ids, PCM, offsets), as an engine call's output would go back. Reported: CPU
time of each side per push (``time.process_time``; the engine process has only IPC and
bookkeeping to do), and push-to-answer latency percentiles at the front-ends. No GPU.

    python scripts/experiments/engine_ipc_cost.py --streams 1024 --frontends 1 --seconds 10
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import threading
import time
from multiprocessing.connection import Client, Listener

import numpy as np

FRAME_S = 2048 / 24000
FRAME_SAMPLES = 2048


def engine(address: str, frontends: int, ready, results) -> None:
    """Accept the front-ends; a reader thread each; one engine thread answering every round."""
    listener = Listener(address, family="AF_UNIX")
    ready.set()
    connections = [listener.accept() for _ in range(frontends)]
    pending: list[tuple[int, tuple]] = []
    lock, wake, done = threading.Lock(), threading.Event(), threading.Event()
    pushes = [0]

    def read(k: int, conn) -> None:
        while True:
            message = conn.recv()
            if message is None:
                break
            with lock:
                pending.append((k, message))
            wake.set()

    readers = [threading.Thread(target=read, args=(k, c), daemon=True) for k, c in enumerate(connections)]
    for t in readers:
        t.start()
    start_cpu = time.process_time()

    def serve() -> None:
        while not done.is_set():
            wake.wait(0.05)
            wake.clear()
            with lock:
                round_, pending[:] = list(pending), []
            by_frontend: dict[int, list] = {}
            for k, (ids, frames, codes) in round_:
                by_frontend.setdefault(k, []).append((ids, frames))
                pushes[0] += len(ids)
            for k, parts in by_frontend.items():  # one answer per front-end per round
                ids = np.concatenate([p[0] for p in parts])
                frames = np.concatenate([p[1] for p in parts])
                offsets = np.concatenate([[0], np.cumsum(frames * FRAME_SAMPLES)])
                connections[k].send((ids, np.zeros(int(offsets[-1]), np.int16), offsets))

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()
    for t in readers:
        t.join()
    done.set()
    worker.join()
    results.put({"engine_cpu_s": time.process_time() - start_cpu, "engine_pushes": pushes[0]})


def frontend(address: str, first: int, count: int, total: int, seconds: float, tick: float, results) -> None:
    """``count`` streams (ids from ``first``), pushing one frame each per frame time, staggered over
    the frame by their id among ``total``; a message per tick."""
    conn = Client(address, family="AF_UNIX")
    sent_at = np.zeros(count)
    latencies: list[float] = []

    def receive() -> None:
        while True:
            message = conn.recv()
            if message is None:
                return
            ids, pcm, offsets = message
            now = time.monotonic()
            latencies.extend((now - sent_at[ids - first]).tolist())

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    start_cpu, start = time.process_time(), time.monotonic()
    phase = (np.arange(first, first + count) / total) * FRAME_S  # when in a frame each stream pushes
    pushed = np.zeros(count, np.int64)  # frames pushed per stream
    codes_per_frame = np.arange(7, dtype=np.int64)
    while True:
        now = time.monotonic() - start
        if now > seconds:
            break
        due = np.flatnonzero(phase + pushed * FRAME_S <= now)
        if due.size:
            pushed[due] += 1
            sent_at[due] = time.monotonic()
            conn.send((due + first, np.ones(due.size, np.int64), np.tile(codes_per_frame, due.size)))
        time.sleep(tick)
    time.sleep(0.3)  # the last answers
    conn.send(None)
    cpu = time.process_time() - start_cpu
    lat = np.array(latencies) * 1e3
    results.put({"frontend_cpu_s": cpu, "pushes": int(pushed.sum()), "answers": len(lat),
                 "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
                 "max_ms": float(lat.max())})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=1024)
    parser.add_argument("--frontends", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--tick-ms", type=float, default=2.0)
    args = parser.parse_args()
    address = os.path.join(tempfile.mkdtemp(), "engine.sock")
    ctx = mp.get_context("spawn")
    ready, results = ctx.Event(), ctx.Queue()
    eng = ctx.Process(target=engine, args=(address, args.frontends, ready, results))
    eng.start()
    ready.wait()
    per = -(-args.streams // args.frontends)
    fronts = [ctx.Process(target=frontend, args=(address, k * per, min(per, args.streams - k * per), args.streams,
                                                 args.seconds, args.tick_ms / 1e3, results))
              for k in range(args.frontends)]
    for p in fronts:
        p.start()
    out = [results.get() for _ in range(args.frontends + 1)]
    for p in (*fronts, eng):
        p.join()
    eng_result = next(r for r in out if "engine_cpu_s" in r)
    front = [r for r in out if "frontend_cpu_s" in r]
    pushes = sum(r["pushes"] for r in front)
    summary = {"streams": args.streams, "frontends": args.frontends, "seconds": args.seconds, "pushes": pushes,
               "pushes_per_s": round(pushes / args.seconds),
               "engine_us_per_push": round(1e6 * eng_result["engine_cpu_s"] / max(pushes, 1), 2),
               "engine_core_share": round(eng_result["engine_cpu_s"] / args.seconds, 3),
               "frontend_us_per_push": round(1e6 * sum(r["frontend_cpu_s"] for r in front) / max(pushes, 1), 2),
               "answer_p50_ms": round(max(r["p50_ms"] for r in front), 2),
               "answer_p99_ms": round(max(r["p99_ms"] for r in front), 2),
               "answer_max_ms": round(max(r["max_ms"] for r in front), 2),
               "all_answered": all(r["answers"] == r["pushes"] for r in front)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
