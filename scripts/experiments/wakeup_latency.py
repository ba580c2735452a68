"""Whether a host delays cross-CPU wake-ups (no GPU, no torch): ping-pong round trips between two
threads (``threading.Event``: a futex wake and the GIL) and between two processes (a pipe: a
futex-free wake-up, no GIL), and a thread sleeping 1 ms as the timer's reference, each for
``--seconds``. Prints each probe's round trips, those over ``--slow-ms`` and when (seconds into the
probe), as JSON: a host whose wake-ups stall periodically shows the same period as a serving
load's stalls (docs/serving.md, "Host variance").

    python scripts/experiments/wakeup_latency.py --seconds 10
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import threading
import time


def _slow(durations: list[tuple[float, float]], slow_ms: float) -> dict:
    ms = sorted(d for _, d in durations)
    slow = [(round(t, 3), round(d, 2)) for t, d in durations if d > slow_ms]
    return {"round_trips": len(ms), "p50_us": round(ms[len(ms) // 2] * 1e3, 1), "p99_us": round(ms[int(len(ms) * 0.99)] * 1e3, 1),
            "max_ms": round(ms[-1], 2), "over_slow_ms": len(slow), "slow_at_s": slow[:60]}


def threads(seconds: float, slow_ms: float) -> dict:
    ping, pong, stop = threading.Event(), threading.Event(), False

    def echo() -> None:
        while not stop:
            if ping.wait(0.1):
                ping.clear()
                pong.set()
    worker = threading.Thread(target=echo, daemon=True)
    worker.start()
    trips, start = [], time.perf_counter()
    while (now := time.perf_counter()) - start < seconds:
        ping.set()
        pong.wait()
        pong.clear()
        trips.append((now - start, (time.perf_counter() - now) * 1e3))
    stop = True
    worker.join()
    return _slow(trips, slow_ms)


def _echo_process(read_fd: int, write_fd: int) -> None:
    while True:
        byte = os.read(read_fd, 1)
        if not byte or byte == b"q":
            return
        os.write(write_fd, byte)


def processes(seconds: float, slow_ms: float) -> dict:
    from_parent, to_child = os.pipe()  # (read end, write end)
    from_child, to_parent = os.pipe()
    child = multiprocessing.get_context("fork").Process(target=_echo_process, args=(from_parent, to_parent))
    child.start()
    trips, start = [], time.perf_counter()
    while (now := time.perf_counter()) - start < seconds:
        os.write(to_child, b"x")
        os.read(from_child, 1)
        trips.append((now - start, (time.perf_counter() - now) * 1e3))
    os.write(to_child, b"q")
    child.join()
    return _slow(trips, slow_ms)


def timer(seconds: float, slow_ms: float) -> dict:
    trips, start = [], time.perf_counter()
    while (now := time.perf_counter()) - start < seconds:
        time.sleep(0.001)
        trips.append((now - start, (time.perf_counter() - now) * 1e3 - 1.0))
    return _slow(trips, slow_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--slow-ms", type=float, default=1.0)
    cli = parser.parse_args()
    for name, probe in (("threads", threads), ("processes", processes), ("timer_1ms_late", timer)):
        print(json.dumps({name: probe(cli.seconds, cli.slow_ms)}), flush=True)


if __name__ == "__main__":
    main()
