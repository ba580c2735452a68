"""The engine process's Python per push (#41), on the CPU: its batcher (`_EngineBatcher`) fed
front-end messages in this process over a stub engine whose step costs nothing and whose output
needs no conversion (on a GPU those are asynchronous), so what is timed is the reader's `take` and
the engine thread's rounds under one GIL. 4,096 streams, 40 pushes a message from 8 front-ends, 40
rounds. Results: docs/serving.md ("One engine process, fed by front-ends").

    python scripts/experiments/engine_host_cost.py [--repeats 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from snac_fast.engine_process import _EngineBatcher, _Front, _push_message

STREAMS, FRONTS, ROUNDS, SAMPLES = 4096, 8, 40, 2048
PER_MESSAGE = 40


class StubSlot:
    __slots__ = ("slot", "started")

    def __init__(self, index: int) -> None:
        self.slot, self.started = index, True


class StubEngine:
    """What the batcher asks of a stream engine, at no cost: one frame of 2,048 samples per push."""

    device, dtype, samples_per_frame, frames_per_group, config = torch.device("cpu"), torch.float32, SAMPLES, 1, {}

    def __init__(self) -> None:
        self.opened, self.audio = 0, torch.zeros(256 * SAMPLES)

    def open(self, seed=None) -> StubSlot:
        self.opened += 1
        return StubSlot(self.opened)

    def close(self, slot) -> None:
        pass

    def step_rows(self, streams, rows, frames):
        return self.audio, np.arange(len(streams) + 1, dtype=np.int64) * SAMPLES


class SilentFront(_Front):
    def __init__(self) -> None:
        self.streams = set()

    def send(self, message) -> None:
        pass

    def send_audio(self, reqs, offsets, pcm) -> None:  # the message is built by a sender thread: not timed here
        pass


def one_run() -> dict:
    batcher = _EngineBatcher(StubEngine(), max_batch=256, output="int16")
    host = torch.zeros(256 * SAMPLES, dtype=torch.int16)
    batcher._to_host = lambda audio: (host, None)  # the GPU converts and copies asynchronously
    sids = np.asarray([batcher.open(i) for i in range(STREAMS)])
    fronts = [SilentFront() for _ in range(FRONTS)]
    rows = np.random.default_rng(0).integers(0, 4096, (STREAMS, 7))
    messages = []
    for r in range(ROUNDS):
        for k in range(0, STREAMS, PER_MESSAGE):
            part = slice(k, min(k + PER_MESSAGE, STREAMS))
            reqs = list(range(r * STREAMS + part.start, r * STREAMS + part.stop))
            messages.append((fronts[(k // PER_MESSAGE) % FRONTS], _push_message(reqs, sids[part].tolist(), 1, list(rows[part]))))
    per_round = -(-STREAMS // PER_MESSAGE)
    started = time.perf_counter()
    for i, (front, message) in enumerate(messages):
        batcher.take(front, message)
        if i % per_round == per_round - 1:  # a round's pushes all queued: let the engine thread catch up
            while batcher.queued:
                time.sleep(0.0002)
    while batcher.queued or batcher.requests < STREAMS * ROUNDS:
        time.sleep(0.0002)
    wall = time.perf_counter() - started
    pushes = STREAMS * ROUNDS
    result = {"us_per_push": wall / pushes * 1e6, "engine_thread_us_per_push": batcher.step_seconds / pushes * 1e6,
              "engine_calls": batcher.batches}
    batcher.close()
    return result


def main() -> None:
    global PER_MESSAGE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--per-message", type=int, default=PER_MESSAGE, help="pushes per front-end message (an H100 run's had ~5)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    PER_MESSAGE = args.per_message
    runs = [one_run() for _ in range(args.repeats)]
    for run in runs:
        print(json.dumps({k: round(v, 2) for k, v in run.items()}))
    summary = {"runs": runs, "median_us_per_push": statistics.median(r["us_per_push"] for r in runs)}
    print(f"median {summary['median_us_per_push']:.2f} us of host time per push (reader + engine thread)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
