"""The batcher's round logic: requests checked on the caller's thread (their streams in a
:class:`~snac_fast.batching.streams.StreamTable`), and a round's engine calls (group, launch, copy
to the host, deliver), whatever runs them.

:class:`BatchRounds` holds no scheduler: a driver (:mod:`snac_fast.batching.drivers`: an engine
thread, or an event loop's pump) takes what is pending (its :class:`~snac_fast.batching.intake.Intake`)
and runs it through :meth:`BatchRounds.split_round`, :meth:`~BatchRounds.calls`,
:meth:`~BatchRounds.launch` and :meth:`~BatchRounds.land`. The batchers of
:mod:`snac_fast.batching.batchers` and the engine process's (:mod:`snac_fast.serve.engine.batcher`)
are rounds plus a driver; the latter overrides the public hooks (:meth:`~BatchRounds.count_pushes`,
:meth:`~BatchRounds.split_round`, :meth:`~BatchRounds.calls`, :meth:`~BatchRounds.mark_done`,
:meth:`~BatchRounds.deliver`) to run blocks of pushes without a Python step per push.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from snac_fast.batching.futures import resolve
from snac_fast.batching.intake import Intake
from snac_fast.batching.pcm import HostCopies, PCMBlock, pcm_of
from snac_fast.batching.streams import Stream, StreamTable
from snac_fast.ops.device import make_current
from snac_fast.orpheus import TokenLayout
from snac_fast.streaming import CheckedCodes, StreamEngine
from snac_fast.streaming.shapes import joined_audio

OUTPUTS = ("tensor", "float32", "int16")


class Request:
    """One push (``frames`` new frames as a level-major row), and/or the stream's end, or a release.
    ``future``: where its result goes (a future, or the engine process's reply address)."""

    __slots__ = ("stream", "frames", "row", "finish", "release", "future", "checked", "queued_at")

    def __init__(self, stream: Stream, frames: int, row: np.ndarray | None, finish: bool, future,
                 release: bool = False, checked: CheckedCodes | None = None) -> None:
        self.stream, self.frames, self.row, self.finish = stream, frames, row, finish
        self.release, self.future, self.checked = release, future, checked
        self.queued_at = 0.0


class Driver(Protocol):
    """What runs a batcher's rounds: told of each queued request, stopped once."""

    def notify(self) -> None:
        """A request was queued (any thread)."""

    def stop(self) -> None:
        """Run what is queued to the end, then stop."""


# an engine call launched: (its chunk of requests, a function that waits for its copy and returns
# each request's result, a function that says without waiting whether the copy has landed)
Launched = tuple[list, Callable[[], object], Callable[[], bool]]


def landed() -> bool:
    return True


def streams_done(streams: list[Stream], now: float) -> None:
    for stream in streams:  # idle time counts from a push's answer, not from its queueing
        stream.last_active, stream.done = now, stream.done + 1


class BatchRounds:
    """Streams on one engine and the engine calls of their pushes, in rounds (a stream once a round).

    max_batch: most streams per engine call; max_wait_ms: how long after the last round a driver
    waits for max_batch pushes (:mod:`~snac_fast.batching.intake`); layout: the token layout of id
    pushes; output: ``"tensor"`` (GPU tensors), ``"float32"`` or ``"int16"`` (host numpy PCM, copied
    once per call through pinned memory); idle_timeout_s: release a stream no push touched for that
    long. :attr:`driver` must be set before the first request (the batchers do)."""

    def __init__(self, engine: StreamEngine, max_batch: int, max_wait_ms: float, layout: TokenLayout | None,
                 output: str, idle_timeout_s: float | None) -> None:
        if max_batch < 1 or max_wait_ms < 0:
            raise ValueError("max_batch must be >= 1 and max_wait_ms >= 0")
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        if idle_timeout_s is not None and idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be positive (or None), got {idle_timeout_s}")
        if layout is not None:
            layout.check_model(engine.config)
        self.engine, self.max_batch = engine, max_batch
        self.layout, self.output, self.idle_timeout = layout, output, idle_timeout_s
        self.driver: Driver | None = None
        self.table = StreamTable(layout)
        self.intake = Intake(max_batch, max_wait_ms, self.count_pushes)  # what waits for a round
        # host PCM of a CUDA engine's calls (None: tensors kept, or a CPU engine's PCM is the host's)
        self.copies = (HostCopies(engine.device, output, max_batch * engine.samples_per_frame * engine.frames_per_group,
                                  engine.dtype) if output != "tensor" and engine.device.type == "cuda" else None)
        # for monitoring: engine calls, requests run, streams released for idling, failed engine calls
        self.batches = self.requests = self.idle_released = self.failed_calls = 0
        # engine calls failed since the last that ran, and the last failure: a device that fails every
        # call (a sticky CUDA error) shows here, for a server's health check
        self.failed_in_a_row, self.last_failure = 0, None
        self.step_seconds = 0.0  # host time in engine calls, copies included

    @property
    def gpu_seconds(self) -> float:
        """CUDA-event time of the engine calls with their copies (:class:`HostCopies`; 0 without)."""
        return 0.0 if self.copies is None else self.copies.gpu_seconds

    # -- streams (any thread) ------------------------------------------------------------------

    def open(self, seed: int | None = None) -> int:
        """A new stream's id (its noise seed: see :meth:`StreamEngine.open`)."""
        slot = self.engine.open(seed)
        stream = self.table.add(slot)
        if stream is None:
            self.engine.close(slot)
            raise RuntimeError("the batcher is closed")
        return stream.id

    @property
    def open_streams(self) -> int:
        return len(self.table)

    def is_open(self, stream_id: int) -> bool:
        """Whether the stream takes pushes (not flushed, released, idled out or failed)."""
        return stream_id in self.table

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (no stream opens after it)."""
        return self.table.closed

    @property
    def queued(self) -> int:
        """Requests waiting for an engine call."""
        return len(self.intake)

    def submit_codes(self, stream_id: int, codes: Sequence[Tensor] | None, finish: bool,
                     drop_incomplete_frame: bool = False, future=None):
        """Queue new codes (checked now) and/or the stream's end; the request's future."""
        stream = self.table.get(stream_id)
        frames, row, checked = 0, None, None
        if codes is not None:
            checked = self.engine.check_codes(codes)
            frames, row = checked.frames, self.engine.row_of(checked)
        if finish:
            if stream.framer is not None:
                stream.framer.drop_incomplete() if drop_incomplete_frame else stream.framer.finish()
            self.table.end(stream, "flushed")
        future = self.new_future() if future is None else future
        return self.queue(Request(stream, frames, row, finish, future, checked=checked))

    def submit_ids(self, stream_id: int, ids):
        """Queue raw LM token ids (checked now; an incomplete frame waits for the next push)."""
        stream = self.table.get(stream_id)
        if stream.framer is None:
            raise ValueError("this batcher has no token layout: make it with layout=... (snac_fast.orpheus)")
        frames, row = stream.framer.push_row(ids)
        future = self.new_future()
        if not frames:
            stream.last_active = time.monotonic()
            resolve(future, self.empty())
            return future
        return self.queue(Request(stream, frames, row, False, future))

    def queue(self, request: Request):
        if self.intake.stopping:
            raise RuntimeError("the batcher is closed")
        request.queued_at = request.stream.last_active = time.monotonic()
        request.stream.queued += 1
        self.intake.put(request, request.queued_at, first_audio=not request.release and not request.stream.slot.started)
        self.driver.notify()
        return request.future

    def release(self, stream_id: int) -> None:
        """Drop a stream without decoding the rest (a client gone): its slot is freed once any push
        of it in flight has run; later pushes to it raise. Safe to call from any thread, twice."""
        stream = self.table.open.get(stream_id)
        if stream is not None and not stream.ended:
            self.table.end(stream, "released", drop=True)
            self.queue(Request(stream, 0, None, False, None, release=True))

    def release_idle(self) -> None:
        """Release the streams no push touched for ``idle_timeout_s`` and none has in flight."""
        for stream in self.table.idle(time.monotonic() - self.idle_timeout):
            self.table.end(stream, f"idle for over {self.idle_timeout:g} s", drop=True)
            self.engine.close(stream.slot)
            self.idle_released += 1

    # -- a round (the driver's thread) ----------------------------------------------------------

    @staticmethod
    def count_pushes(queued) -> int:
        """Pushes in ``queued`` (a hook: the engine process's items are blocks of pushes)."""
        return len(queued)

    def split_round(self, batch: list) -> tuple[list, list]:
        """(what runs this round, what waits for the next): a stream's later requests wait for its
        earlier one."""
        now, carried, seen = [], [], set()
        for request in batch:
            if request.stream in seen:
                carried.append(request)
            else:
                seen.add(request.stream)
                now.append(request)
        return now, carried

    def calls(self, requests: list) -> list[tuple[list, Callable[[], tuple[Tensor, np.ndarray]]]]:
        """A round's engine calls: (requests, the call); releases and dropped streams' pushes are
        handled here, without a call."""
        steps: dict[int, list[Request]] = {}
        ends: list[Request] = []
        for r in requests:
            if r.release:
                self.engine.close(r.stream.slot)
            elif r.finish:
                ends.append(r)
            elif r.stream.dropped:  # released after this push was queued: skip its work
                self.deliver([r], [r.stream.released_error()])
            else:
                steps.setdefault(r.frames, []).append(r)
        calls = [(chunk, lambda c=chunk: self._step(c)) for group in steps.values()
                 for chunk in (group[i:i + self.max_batch] for i in range(0, len(group), self.max_batch))]
        calls += [(chunk, lambda c=chunk: self._finish(c))  # flush graphs are warmed up to max_batch rows
                  for chunk in (ends[i:i + self.max_batch] for i in range(0, len(ends), self.max_batch))]
        return calls

    def mark_done(self, requests: list, now: float) -> None:
        """A round's requests have run (a hook, as :meth:`count_pushes`)."""
        streams_done([r.stream for r in requests], now)
        self.requests += len(requests)

    def timed(self, work: Callable, *args):
        """``work(*args)``, its time counted as the driver's time in engine calls."""
        started = time.perf_counter()
        try:
            return work(*args)
        finally:
            self.step_seconds += time.perf_counter() - started

    def launch(self, chunk: list, call: Callable[[], tuple[Tensor, np.ndarray]]) -> Launched:
        """Run one engine call and start its copy to the host (see :data:`Launched`)."""
        begun = None if self.copies is None else self.copies.begin()
        try:
            audio, offsets = call()
            self.batches += 1
            self.failed_in_a_row = 0
            if self.output == "tensor":
                pieces = list(torch.split(audio, np.diff(offsets).tolist()))
                return chunk, lambda: pieces, landed  # GPU tensors: ordered on the stream already
            pcm = pcm_of(audio, self.output)
            host, copied = (pcm, None) if self.copies is None else self.copies.start(pcm)
        except ValueError as error:  # refused before any work: a closed stream, an end mid-window
            if len(chunk) == 1:
                return chunk, lambda e=error: [e], landed
            results = [self.launch([r], lambda r=r: (self._finish if r.finish else self._step)([r])) for r in chunk]
            return chunk, lambda: [p()[0] for _, p, _ in results], lambda: all(ready() for _, _, ready in results)
        except Exception as error:  # noqa: BLE001 - an out-of-memory, a driver error: only this call fails
            self.failed_calls += 1
            self.failed_in_a_row += 1
            self.last_failure = f"{type(error).__name__}: {error}"[:300]
            for r in chunk:
                self.table.end(r.stream, f"its engine call failed: {type(error).__name__}", drop=True)
                self.engine.close(r.stream.slot)
            return chunk, lambda e=error: [e] * len(chunk), landed

        def wait() -> PCMBlock:
            if copied is None:
                return PCMBlock(host.numpy()[:offsets[-1]].copy(), offsets)
            return self.copies.block(host, copied, begun, offsets)
        return chunk, wait, landed if copied is None else copied.query

    def land(self, launched: tuple) -> None:
        """Deliver a launched call's results (waiting for its copy); with its round's requests, mark
        that round done. ``launched``: (its round's requests or None, chunk, wait, ready)."""
        round_requests, chunk, wait, _ = launched
        self.deliver(chunk, wait())
        if round_requests is not None:
            self.mark_done(round_requests, time.monotonic())

    def fail(self, requests: list, error: Exception) -> None:
        """Fail ``requests`` and everything pending after an unexpected error of a driver (a bug of
        ours: what waits fails rather than hangs)."""
        requests = list(requests) + self.intake.take()
        failure = RuntimeError(f"the batcher failed: {type(error).__name__}: {error}")
        self.deliver(requests, [failure] * len(requests))

    def _step(self, pushes: list[Request]) -> tuple[Tensor, np.ndarray]:
        return self.engine.step_rows([r.stream.slot for r in pushes], np.stack([r.row for r in pushes]), pushes[0].frames)

    def _finish(self, ends: list[Request]) -> tuple[Tensor, np.ndarray]:
        pushes = {r.stream.slot: r.checked for r in ends if r.checked is not None}
        audio = self.engine.advance(pushes, [r.stream.slot for r in ends])
        return joined_audio([audio[r.stream.slot] for r in ends])


    def bind_thread(self) -> None:
        """The calling thread runs the engine calls: the engine's device made current on it once."""
        make_current(self.engine.device)

    def empty(self):
        """A push's result when it completed no frame."""
        if self.output == "tensor":
            return self.engine.empty_audio()
        return np.empty(0, np.int16 if self.output == "int16" else np.float32)

    # -- results (the batchers) -----------------------------------------------------------------

    def new_future(self):
        raise NotImplementedError

    def deliver(self, requests: list, results: list) -> None:
        raise NotImplementedError

    # -- shutting down -------------------------------------------------------------------------

    def close(self) -> None:
        """Finish the queued requests, then stop the driver (open streams are released)."""
        streams = self.table.close()
        if streams is None:
            return
        self.intake.stopping = True
        self.driver.stop()
        for request in self.intake.take():  # queued while the driver was stopping: nobody will run them
            self.deliver([request], [RuntimeError("the batcher is closed")])
        for s in streams:
            s.ended = "the batcher closed"
            self.engine.close(s.slot)
