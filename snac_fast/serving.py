"""Batching of concurrent streams for servers: many streams' pushes decoded together on one
:class:`~snac_fast.streaming.StreamEngine`.

:class:`AsyncStreamBatcher` is the asyncio form (``await batcher.push_ids(stream_id, ids)``),
:class:`StreamBatcher` the thread-safe blocking one (``push`` waits; ``submit`` returns a
``concurrent.futures.Future``). Both share one design, built for the host to keep up with the GPU:

- A push is checked and framed on the caller's thread with numpy alone (ids to codes, no torch
  call), then appended to a deque (no lock).
- The engine calls run on one thread: :class:`StreamBatcher`'s engine thread (woken only when it
  sleeps), or by default :class:`AsyncStreamBatcher`'s event loop itself, between its other
  callbacks (no second thread takes the interpreter between the engine's CUDA calls; on some hosts
  that hand-over stalls them: docs/serving.md). It takes whatever is pending when the GPU frees
  (``max_wait_ms`` > 0: waits that long for more when fewer than ``max_batch`` are pending), runs
  it in chunks of ``max_batch`` streams, one :meth:`StreamEngine.step_rows` each, two calls in
  flight, and hands each call's results out at once (one wake-up of the event loop per call, not
  per push, where an engine thread runs them).
- ``output="int16"`` or ``"float32"``: host PCM (numpy), copied from the GPU once per engine call
  into pinned memory, instead of GPU tensors.
- A cancelled ``await`` (a client that disconnected) releases only its stream; a stream idle for
  ``idle_timeout_s`` is released; a push to a released stream raises a ``ValueError`` naming why;
  an engine call that fails (out of memory) fails and releases only the streams of that call, and
  the batcher serves on.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections import deque
from concurrent.futures import Future
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from snac_fast.ops._runtime import make_current
from snac_fast.orpheus import TokenFramer, TokenLayout
from snac_fast.streaming import CheckedCodes, StreamEngine, StreamSlot
from snac_fast.streaming.engine import joined_audio

OUTPUTS = ("tensor", "float32", "int16")


class _Stream:
    """A batcher's stream: its engine slot, token framer and activity."""

    __slots__ = ("id", "slot", "framer", "last_active", "ended", "dropped", "queued", "done")

    def __init__(self, stream_id: int, slot: StreamSlot, framer: TokenFramer | None) -> None:
        self.id, self.slot, self.framer = stream_id, slot, framer
        self.last_active = time.monotonic()
        # requests queued (by callers) and run (by the engine calls): a stream with one in flight is not idle
        self.queued = self.done = 0
        self.ended: str | None = None  # why it takes no more pushes (flushed, released, ...)
        self.dropped = False  # released without its audio: its queued work is skipped

    def released_error(self) -> ValueError:
        """What a push queued before the stream was released gets."""
        return ValueError(f"stream {self.id} was released ({self.ended})")


class _Request:
    """One push (``frames`` new frames as a level-major row), and/or the stream's end, or a release."""

    __slots__ = ("stream", "frames", "row", "finish", "release", "future", "checked", "queued_at")

    def __init__(self, stream: _Stream, frames: int, row: np.ndarray | None, finish: bool, future,
                 release: bool = False, checked: CheckedCodes | None = None) -> None:
        self.stream, self.frames, self.row, self.finish = stream, frames, row, finish
        self.release, self.future, self.checked = release, future, checked
        self.queued_at = 0.0


class _Batcher:
    """What the batchers share: streams, checks on the caller's thread, the engine calls in rounds,
    run by an engine thread (``engine_thread=True``) or, without one, by an event loop bound with
    :meth:`_bind` (its pump launches and polls the calls between the loop's other callbacks).
    Subclasses say how a result reaches its caller (:meth:`_new_future`, :meth:`_deliver`)."""

    def __init__(self, engine: StreamEngine, max_batch: int = 64, max_wait_ms: float = 0.0,
                 layout: TokenLayout | None = None, output: str = "tensor",
                 idle_timeout_s: float | None = None, engine_thread: bool = True) -> None:
        if max_batch < 1 or max_wait_ms < 0:
            raise ValueError("max_batch must be >= 1 and max_wait_ms >= 0")
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        if idle_timeout_s is not None and idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be positive (or None), got {idle_timeout_s}")
        if layout is not None:
            layout.check_model(engine.config)
        self.engine, self.max_batch, self.max_wait = engine, max_batch, max_wait_ms / 1000.0
        self.layout, self.output, self.idle_timeout = layout, output, idle_timeout_s
        self._streams: dict[int, _Stream] = {}
        self._ended: dict[int, str] = {}  # stream id -> why it ended (the most recent ones)
        self._next_id = 0
        self._lock = threading.Lock()  # the streams
        # pushes append to a deque (atomic: no lock on the hot path) and set the event only while the
        # engine thread sleeps (it announces that in _sleeping, then looks at the deque once more)
        self._pending: deque[_Request] = deque()
        self._wake = threading.Event()
        self._sleeping = False
        self._stopping = False
        self._closed = False
        # host PCM of the engine calls in flight lands here; a call's buffer is free again once its
        # results are copied out (two calls are undelivered at most, more only while a refused push's
        # call is retried push by push)
        self._free_pinned: list[Tensor] = []
        self._stream_of_engine_thread: torch.cuda.Stream | None = None
        if output != "tensor" and engine.device.type == "cuda":  # allocated now, not under load (cudaHostAlloc)
            size = max_batch * engine.samples_per_frame * engine.frames_per_group
            self._free_pinned = [torch.empty(size, dtype=torch.int16 if output == "int16" else torch.float32,
                                             pin_memory=True) for _ in range(3)]
            # the conversion kernels' first launches (lazy module loads) now, not in the first pushes
            host, copied = self._to_host(torch.zeros(size, device=engine.device, dtype=engine.dtype))
            copied.synchronize()
            self._free_pinned.append(host)
            self._stream_of_engine_thread = None  # the engine thread's own stream, later
        # for monitoring: engine calls, requests run, streams released for idling, failed engine calls
        self.batches = self.requests = self.idle_released = self.failed_calls = 0
        # engine calls failed since the last that ran, and the last failure: a device that fails every
        # call (a sticky CUDA error) shows here, for a server's health check
        self.failed_in_a_row, self.last_failure = 0, None
        self.step_seconds = 0.0  # host time in engine calls, copies included
        # CUDA-event time from each engine call's start to its copy's end (PCM outputs on CUDA): an
        # upper bound of the GPU's busy time (it includes the gaps while the host launches)
        self.gpu_seconds = 0.0
        # without an engine thread: the event loop that runs the engine calls (bound by _bind),
        # calls formed but not yet launched, calls launched and not yet delivered (oldest first)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._carried: list[_Request] = []  # a stream's later requests wait for its earlier one
        self._queued_calls: deque[tuple] = deque()  # (round's requests on its last call, chunk, call)
        self._in_flight: deque[tuple] = deque()  # (round's requests or None, chunk, wait, ready)
        self._pump_scheduled = False
        self._wait_timer: asyncio.TimerHandle | None = None
        self._sweep_timer: asyncio.TimerHandle | None = None
        self._worker: threading.Thread | None = None
        if engine_thread:
            self._worker = threading.Thread(target=self._serve, name="snac-fast-batcher", daemon=True)
            self._worker.start()

    # -- streams (any thread) ------------------------------------------------------------------

    def open(self, seed: int | None = None) -> int:
        """A new stream's id (its noise seed: see :meth:`StreamEngine.open`)."""
        slot = self.engine.open(seed)
        with self._lock:
            if self._closed:
                self.engine.close(slot)
                raise RuntimeError("the batcher is closed")
            stream_id, self._next_id = self._next_id, self._next_id + 1
            self._streams[stream_id] = _Stream(stream_id, slot, self.layout.framer() if self.layout else None)
        return stream_id

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def is_open(self, stream_id: int) -> bool:
        """Whether the stream takes pushes (not flushed, released, idled out or failed)."""
        return stream_id in self._streams

    @property
    def queued(self) -> int:
        """Requests waiting for an engine call."""
        return len(self._pending)

    def _stream(self, stream_id: int) -> _Stream:
        stream = self._streams.get(stream_id)
        if stream is None or stream.ended:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            why = self._ended.get(stream_id)
            if why is None:
                raise ValueError(f"no open stream {stream_id!r}")
            raise ValueError(f"stream {stream_id} has ended ({why}); open a new one")
        return stream

    def _submit_codes(self, stream_id: int, codes: Sequence[Tensor] | None, finish: bool,
                      drop_incomplete_frame: bool = False, future=None):
        stream = self._stream(stream_id)
        frames, row, checked = 0, None, None
        if codes is not None:
            checked = self.engine.check_codes(codes)
            frames, row = checked.frames, self.engine.row_of(checked)
        if finish:
            if stream.framer is not None:
                stream.framer.drop_incomplete() if drop_incomplete_frame else stream.framer.finish()
            self._end(stream, "flushed")
        future = self._new_future() if future is None else future
        return self._queue(_Request(stream, frames, row, finish, future, checked=checked))

    def _submit_ids(self, stream_id: int, ids):
        stream = self._stream(stream_id)
        if stream.framer is None:
            raise ValueError("this batcher has no token layout: make it with layout=... (snac_fast.orpheus)")
        frames, row = stream.framer.push_row(ids)
        future = self._new_future()
        if not frames:
            stream.last_active = time.monotonic()
            self._resolve(future, self._empty())
            return future
        return self._queue(_Request(stream, frames, row, False, future))

    def _queue(self, request: _Request):
        if self._stopping:
            raise RuntimeError("the batcher is closed")
        request.queued_at = request.stream.last_active = time.monotonic()
        request.stream.queued += 1
        self._pending.append(request)
        self._notify()
        return request.future

    def release(self, stream_id: int) -> None:
        """Drop a stream without decoding the rest (a client gone): its slot is freed once any push
        of it in flight has run; later pushes to it raise. Safe to call from any thread, twice."""
        stream = self._streams.get(stream_id)
        if stream is not None and not stream.ended:
            self._end(stream, "released", drop=True)
            self._queue(_Request(stream, 0, None, False, None, release=True))

    def _end(self, stream: _Stream, why: str, drop: bool = False) -> None:
        with self._lock:
            stream.ended = stream.ended or why
            stream.dropped = stream.dropped or drop
            if self._streams.pop(stream.id, None) is not None:
                self._ended[stream.id] = stream.ended
                if len(self._ended) > 4096:  # the reasons of recent ends, for the errors of late pushes
                    del self._ended[next(iter(self._ended))]

    # -- the engine thread ---------------------------------------------------------------------

    def _serve(self) -> None:
        make_current(self.engine.device)  # per thread: the engine's device_scope is then a no-op per call
        carried: list[_Request] = []  # a stream's later requests wait for its earlier one
        in_flight = None  # the last engine call of the round before, launched but not yet delivered
        next_sweep = time.monotonic() + (self.idle_timeout or 0) / 4
        while True:
            taken: list = []
            try:
                if in_flight is not None and not self._pending and not carried:
                    in_flight = self._timed(self._land, in_flight)  # nothing to launch meanwhile: deliver it now
                while not self._pending and not carried and not self._stopping:
                    self._sleep(self.idle_timeout / 4 if self.idle_timeout else None)
                    if self.idle_timeout and time.monotonic() >= next_sweep:
                        break
                if self.max_wait and self._pending and self._batch_unfilled(carried):
                    if in_flight is not None:
                        in_flight = self._timed(self._land, in_flight)
                    deadline = self._pending[0].queued_at + self.max_wait
                    while not self._stopping and self._batch_unfilled(carried):
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._sleep(left)
                taken = [self._pending.popleft() for _ in range(len(self._pending))]
                if self._stopping and not taken and not carried:
                    if in_flight is not None:
                        self._timed(self._land, in_flight)
                    return
                if self.idle_timeout and time.monotonic() >= next_sweep:
                    self._release_idle()
                    next_sweep = time.monotonic() + self.idle_timeout / 4
                now, carried = self._split_round(carried + taken if carried else taken)
                if now:
                    in_flight = self._timed(self._run, now, in_flight)
                elif in_flight is not None:
                    in_flight = self._timed(self._land, in_flight)
            except Exception as error:  # noqa: BLE001 - a bug of ours: fail what waits rather than hang every stream
                # the call in flight: its round's requests (which hold its own), else its chunk's
                lost = carried + taken + ([] if in_flight is None else list(in_flight[0] or in_flight[1]))
                carried, taken, in_flight = [], [], None
                self._fail_all(error, lost)

    @staticmethod
    def _pushes(queued) -> int:
        """Pushes in ``queued`` (the engine process's items are blocks of pushes; the reader thread
        may append to a deque meanwhile)."""
        return len(queued)

    def _batch_unfilled(self, carried: list) -> bool:
        """Fewer pushes pending and carried than one call takes (``max_wait_ms`` waits for more)."""
        return self._pushes(self._pending) + self._pushes(carried) < self.max_batch

    def _split_round(self, batch: list) -> tuple[list, list]:
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

    def _sleep(self, timeout: float | None) -> None:
        """Wait (the engine thread) until a push sets the event, or ``timeout`` seconds."""
        self._sleeping = True
        if not self._pending and not self._stopping:  # a push between the caller's look and the flag
            self._wake.wait(timeout)
        self._wake.clear()
        self._sleeping = False

    def _release_idle(self) -> None:
        limit = time.monotonic() - self.idle_timeout
        with self._lock:
            idle = [s for s in self._streams.values() if s.last_active < limit and s.queued == s.done]
        for stream in idle:
            self._end(stream, f"idle for over {self.idle_timeout:g} s", drop=True)
            self.engine.close(stream.slot)
            self.idle_released += 1

    def _run(self, requests: list, in_flight: tuple | None) -> tuple | None:
        """One round: group the requests into engine calls and launch them in order. Each call's
        results are handed out while the next call runs on the GPU (its copy precedes that call in
        the stream), and the round's last call stays in flight, handed out once the next round's
        first call is launched (or before the engine thread sleeps): the host's deliveries and the
        next round's grouping overlap the GPU instead of following it. A stream's pushes are
        launched in order, so its state on the GPU is too. ``in_flight``: the round before's last
        call, (its round's requests, chunk, wait, ready). Returns this round's."""
        previous, launched = in_flight, None
        for chunk, call in self._calls(requests):
            launched = (None, *self._launch(chunk, call))
            if previous is not None:
                self._land(previous)
            previous = launched
        if launched is None:  # no engine call (releases, dropped pushes): done now
            self._mark_done(requests, time.monotonic())
            return previous
        return (requests, *launched[1:])

    def _timed(self, work: Callable, *args):
        """``work(*args)``, its time counted as the engine thread's time in engine calls."""
        started = time.perf_counter()
        try:
            return work(*args)
        finally:
            self.step_seconds += time.perf_counter() - started

    def _land(self, launched: tuple) -> None:
        """Deliver a launched call's results (waiting for its copy); with its round's requests, mark
        that round done. ``launched``: (its round's requests or None, chunk, wait, ready)."""
        round_requests, chunk, wait, _ = launched
        self._deliver(chunk, wait())
        if round_requests is not None:
            self._mark_done(round_requests, time.monotonic())

    def _mark_done(self, requests: list[_Request], now: float) -> None:
        _streams_done([r.stream for r in requests], now)
        self.requests += len(requests)

    def _calls(self, requests: list[_Request]) -> list[tuple[list[_Request], Callable[[], tuple[Tensor, np.ndarray]]]]:
        """A round's engine calls: (requests, the call); releases and dropped streams' pushes are
        handled here, without a call."""
        steps: dict[int, list[_Request]] = {}
        ends: list[_Request] = []
        for r in requests:
            if r.release:
                self.engine.close(r.stream.slot)
            elif r.finish:
                ends.append(r)
            elif r.stream.dropped:  # released after this push was queued: skip its work
                self._deliver([r], [r.stream.released_error()])
            else:
                steps.setdefault(r.frames, []).append(r)
        calls = [(chunk, lambda c=chunk: self._step(c)) for group in steps.values()
                 for chunk in (group[i:i + self.max_batch] for i in range(0, len(group), self.max_batch))]
        calls += [(chunk, lambda c=chunk: self._finish(c))  # flush graphs are warmed up to max_batch rows
                  for chunk in (ends[i:i + self.max_batch] for i in range(0, len(ends), self.max_batch))]
        return calls

    def _step(self, pushes: list[_Request]) -> tuple[Tensor, np.ndarray]:
        return self.engine.step_rows([r.stream.slot for r in pushes], np.stack([r.row for r in pushes]), pushes[0].frames)

    def _finish(self, ends: list[_Request]) -> tuple[Tensor, np.ndarray]:
        pushes = {r.stream.slot: r.checked for r in ends if r.checked is not None}
        audio = self.engine.advance(pushes, [r.stream.slot for r in ends])
        return joined_audio([audio[r.stream.slot] for r in ends])

    def _launch(self, chunk: list[_Request], call: Callable[[], tuple[Tensor, np.ndarray]]):
        """Run one engine call and start its copy to the host; returns (chunk, a function that
        waits for the copy and returns each request's result or error, a function that says
        without waiting whether the copy has landed)."""
        begun = None
        if self.output != "tensor" and self.engine.device.type == "cuda":
            begun = torch.cuda.Event(enable_timing=True)
            begun.record(self._cuda_stream())
        try:
            audio, offsets = call()
            self.batches += 1
            self.failed_in_a_row = 0
            if self.output == "tensor":
                pieces = list(torch.split(audio, np.diff(offsets).tolist()))
                return chunk, lambda: pieces, _landed  # GPU tensors: ordered on the stream already
            host, copied = self._to_host(audio)
        except ValueError as error:  # refused before any work: a closed stream, an end mid-window
            if len(chunk) == 1:
                return chunk, lambda e=error: [e], _landed
            results = [self._launch([r], lambda r=r: self._single(r)) for r in chunk]
            return chunk, lambda: [p()[0] for _, p, _ in results], lambda: all(ready() for _, _, ready in results)
        except Exception as error:  # noqa: BLE001 - an out-of-memory, a driver error: only this call fails
            self.failed_calls += 1
            self.failed_in_a_row += 1
            self.last_failure = f"{type(error).__name__}: {error}"[:300]
            for r in chunk:
                self._end(r.stream, f"its engine call failed: {type(error).__name__}", drop=True)
                self.engine.close(r.stream.slot)
            return chunk, lambda e=error: [e] * len(chunk), _landed

        def wait() -> list:
            if copied is not None:
                copied.synchronize()  # releases the GIL: the event loop runs meanwhile
                self.gpu_seconds += begun.elapsed_time(copied) / 1e3
            block = PCMBlock(host.numpy()[:offsets[-1]].copy(), offsets)
            if copied is not None:
                self._free_pinned.append(host)  # copied out: the pinned buffer can take another call's PCM
            return block
        return chunk, wait, _landed if copied is None else copied.query

    def _single(self, request: _Request) -> tuple[Tensor, np.ndarray]:
        if request.finish:
            return self._finish([request])
        return self.engine.step_rows([request.stream.slot], request.row[None], request.frames)

    def _to_host(self, audio: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
        """Convert on the device and start one copy into a free pinned buffer (the caller returns
        it to ``_free_pinned`` once the PCM is copied out)."""
        if self.output == "int16":
            audio = int16_pcm(audio)
        elif audio.dtype != torch.float32:
            audio = audio.float()
        if audio.device.type != "cuda":
            return audio, None
        host = self._free_pinned.pop() if self._free_pinned else None
        if host is None or host.numel() < audio.numel() or host.dtype != audio.dtype:
            host = torch.empty(max(audio.numel(), 2 * (0 if host is None else host.numel())), dtype=audio.dtype,
                               pin_memory=True)
        host[:audio.numel()].copy_(audio, non_blocking=True)
        copied = torch.cuda.Event(enable_timing=True)
        copied.record(self._cuda_stream())
        return host, copied

    def _cuda_stream(self) -> torch.cuda.Stream:
        """The engine thread's CUDA stream, looked up once (each lookup queries the driver)."""
        if self._stream_of_engine_thread is None:
            self._stream_of_engine_thread = torch.cuda.current_stream(self.engine.device)
        return self._stream_of_engine_thread

    def _empty(self):
        if self.output == "tensor":
            return self.engine.empty_audio()
        return np.empty(0, np.int16 if self.output == "int16" else np.float32)

    # -- the engine calls on an event loop (engine_thread=False) -------------------------------

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the engine calls on ``loop`` (called on its thread; without an engine thread only)."""
        self._loop, self._loop_thread = loop, threading.get_ident()
        make_current(self.engine.device)  # this thread runs the engine calls
        if self.idle_timeout:
            self._sweep_timer = loop.call_later(self.idle_timeout / 4, self._sweep)

    def _notify(self) -> None:
        """A request was queued: wake the engine thread if it sleeps, or schedule the loop's pump."""
        if self._worker is not None:
            if self._sleeping:
                self._wake.set()
            return
        if self._loop is None or self._pump_scheduled or self._loop.is_closed():
            return  # no loop yet, or its loop has closed: the next loop's first push (or close()) takes it
        if threading.get_ident() == self._loop_thread:
            self._pump_scheduled = True
            self._loop.call_soon(self._pump)
        else:  # a release from another thread
            try:
                self._loop.call_soon_threadsafe(self._notify)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _pump(self) -> None:
        """Deliver the calls whose copies landed (oldest first: one CUDA stream, they land in order),
        launch calls while fewer than two are in flight, and while any is in flight, look again after
        the loop's other callbacks (the pushes they queue go into the next call)."""
        self._pump_scheduled = False
        try:
            while True:
                while self._in_flight and self._in_flight[0][3]():
                    self._timed(self._land, self._in_flight.popleft())
                if len(self._in_flight) >= 2 or not (self._queued_calls or self._take_round()):
                    break
                self._launch_next()
        except Exception as error:  # noqa: BLE001 - a bug of ours: fail what waits rather than hang every stream
            self._fail_all(error)
            raise
        if self._in_flight or self._queued_calls:
            self._pump_scheduled = True
            self._loop.call_soon(self._pump)

    def _take_round(self) -> bool:
        """Form the next round's engine calls from what is pending (a stream once a round); with
        ``max_wait_ms``, only once enough is pending or the first pending push has waited that long.
        Returns whether calls were formed."""
        while self._pending or self._carried:
            pending = len(self._pending)
            if self.max_wait and pending and not self._stopping and self._batch_unfilled(self._carried):
                left = self._pending[0].queued_at + self.max_wait - time.monotonic()
                if left > 0:
                    if self._wait_timer is None:
                        self._wait_timer = self._loop.call_later(left, self._wait_over)
                    return False
            taken = [self._pending.popleft() for _ in range(pending)]
            now, self._carried = self._split_round(self._carried + taken if self._carried else taken)
            calls = self._calls(now)
            if not calls:  # releases and dropped pushes only: done now
                self._mark_done(now, time.monotonic())
                continue
            self._queued_calls.extend((None, chunk, call) for chunk, call in calls[:-1])
            self._queued_calls.append((now, *calls[-1]))
            return True
        return False

    def _wait_over(self) -> None:
        self._wait_timer = None
        self._notify()

    def _sweep(self) -> None:
        if self._closed:
            return
        self._release_idle()
        self._sweep_timer = self._loop.call_later(self.idle_timeout / 4, self._sweep)

    def _fail_all(self, error: Exception, lost: list = ()) -> None:
        """Fail every request queued or in flight, and ``lost`` (after an unexpected error of the
        pump or the engine thread; a request failed twice gets the first error)."""
        requests = [r for entry in self._in_flight for r in entry[1]] + [r for entry in self._queued_calls for r in entry[1]]
        requests += list(lost) + self._carried + list(self._pending)
        self._in_flight.clear(), self._queued_calls.clear(), self._pending.clear(), self._carried.clear()
        failure = RuntimeError(f"the batcher failed: {type(error).__name__}: {error}")
        self._deliver(requests, [failure] * len(requests))

    def _stop_engine(self) -> None:
        """Run what is queued, then stop: the engine thread, or the loop's timers (closing)."""
        if self._worker is not None:
            self._wake.set()
            self._worker.join()
            return
        self._cancel_timers()
        running = self._loop is not None and self._loop.is_running()
        if running and threading.get_ident() != self._loop_thread:  # closed from another thread
            done = Future()

            def drain() -> None:  # on the loop; an error reaches close()'s caller instead of hanging it
                try:
                    done.set_result(self._drain())
                except BaseException as error:  # noqa: BLE001 - handed on as it is
                    done.set_exception(error)
            self._loop.call_soon_threadsafe(drain)
            done.result()
        else:
            self._drain()

    def _drain(self) -> None:
        """Run everything queued to the end, waiting for each call (closing)."""
        while self._in_flight or self._queued_calls or self._take_round():
            if self._in_flight:
                self._timed(self._land, self._in_flight.popleft())
            else:
                self._launch_next()

    def _launch_next(self) -> None:
        """Launch the oldest formed call; it joins the calls in flight."""
        round_requests, chunk, call = self._queued_calls.popleft()
        self._in_flight.append((round_requests, *self._timed(self._launch, chunk, call)))

    def _cancel_timers(self) -> None:
        """Drop the loop's timers (max_wait_ms, idle release): closing, or moving to another loop."""
        for timer in (self._wait_timer, self._sweep_timer):
            if timer is not None:
                timer.cancel()
        self._wait_timer = self._sweep_timer = None

    # -- results (subclasses) ------------------------------------------------------------------

    def _new_future(self):
        raise NotImplementedError

    def _deliver(self, requests: list[_Request], results: list) -> None:
        raise NotImplementedError

    @staticmethod
    def _resolve(future, result) -> None:
        """Set a future's result (or exception), unless its caller gave up on it (cancelled)."""
        if future is None or future.done():
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    # -- shutting down -------------------------------------------------------------------------

    def close(self) -> None:
        """Finish the queued requests, then stop the engine thread (open streams are released)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            streams = list(self._streams.values())
            self._streams.clear()
        self._stopping = True
        self._stop_engine()
        while self._pending:  # queued while the engine thread was stopping: nobody will run them
            request = self._pending.popleft()
            self._deliver([request], [RuntimeError("the batcher is closed")])
        for s in streams:
            s.ended = "the batcher closed"
            self.engine.close(s.slot)


class StreamBatcher(_Batcher):
    """Runs the pushes of many streams in batches on one engine, for threads.

    max_batch: most streams per engine call (larger batches run in several calls); max_wait_ms: how
    long the engine thread, finding fewer than max_batch requests, waits for more (0: whatever is
    pending when the GPU frees). layout: token layout for :meth:`push_ids`
    (:data:`snac_fast.orpheus.ORPHEUS`). output: ``"tensor"`` (1-D GPU tensors in the engine's
    dtype), ``"float32"`` or ``"int16"`` (1-D numpy PCM). idle_timeout_s: release a stream no push
    touched for that long. A stream's requests run in order; a bad request fails its own future (or
    raises in the caller) and no other. Use as a context manager, or call :meth:`close`.
    """

    def submit(self, stream_id: int, codes: Sequence[Tensor] | None = None, *, finish: bool = False) -> Future:
        """Queue new codes (k >= 1 frames, checked now) and/or the stream's end; the future's result
        is the stream's audio that became final."""
        return self._submit_codes(stream_id, codes, finish)

    def submit_ids(self, stream_id: int, ids) -> Future:
        """Queue raw LM token ids (checked now; an incomplete frame waits for the next push)."""
        return self._submit_ids(stream_id, ids)

    def push(self, stream_id: int, codes: Sequence[Tensor]):
        return self.submit(stream_id, codes).result()

    def push_ids(self, stream_id: int, ids):
        return self.submit_ids(stream_id, ids).result()

    def flush(self, stream_id: int, *, drop_incomplete_frame: bool = False):
        """End the stream: the rest of its audio. ``drop_incomplete_frame``: ids of a frame left
        incomplete (an LM cut off mid-frame) are dropped instead of raising ValueError."""
        return self._submit_codes(stream_id, None, True, drop_incomplete_frame).result()

    def _new_future(self) -> Future:
        return Future()

    def _deliver(self, requests: list[_Request], results: list) -> None:
        for r, result in zip(requests, results):
            try:
                self._resolve(r.future, result)
            except Exception:  # noqa: BLE001 - cancelled by its caller in between: nobody waits
                pass

    def __enter__(self) -> "StreamBatcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncStreamBatcher(_Batcher):
    """The asyncio form: ``await push_ids(stream_id, ids)`` (or ``push`` of codes) returns that
    stream's audio that became final; options as :class:`StreamBatcher`. Cancelling an awaiting task
    (a client that disconnected) releases its stream and nothing else.

    engine_thread: ``False`` (the default): the engine calls run on the event loop's own thread,
    between its other callbacks: a call is launched when pushes are pending and fewer than two
    calls are in flight, and each call's copy to the host is polled (never waited for) until it
    lands, its results then set directly. No second thread takes the interpreter between the
    engine's CUDA calls; on the hosts where that thread hand-over stalls every CUDA call for tens of
    milliseconds every ~1.5 s, this takes 64 streams' p99 from 19-27 ms to 4.5-5.7 ms
    (docs/serving.md). Every push must then come from one event loop (the first that pushes; once
    it has closed, the next one), and :meth:`close` runs what is queued on it. ``True``: a thread of the batcher runs the engine calls
    (pushes from any event loops), results reach each loop in one wake-up per engine call.
    """

    def __init__(self, engine: StreamEngine, max_batch: int = 64, max_wait_ms: float = 0.0,
                 layout: TokenLayout | None = None, output: str = "tensor",
                 idle_timeout_s: float | None = None, *, engine_thread: bool = False) -> None:
        super().__init__(engine, max_batch, max_wait_ms, layout, output, idle_timeout_s, engine_thread=engine_thread)

    def open(self, seed: int | None = None) -> int:
        if self._worker is None and self._loop is None:
            try:
                self._bind(asyncio.get_running_loop())  # idle release counts from now
            except RuntimeError:  # opened outside a loop: bound at the first push
                pass
        return super().open(seed)

    async def push(self, stream_id: int, codes: Sequence[Tensor]):
        self._check_loop()
        return await self._awaited(stream_id, self._submit_codes(stream_id, codes, False))

    async def push_ids(self, stream_id: int, ids):
        self._check_loop()
        return await self._awaited(stream_id, self._submit_ids(stream_id, ids))

    async def flush(self, stream_id: int, *, drop_incomplete_frame: bool = False):
        """End the stream: the rest of its audio (``drop_incomplete_frame``: as :meth:`StreamBatcher.flush`)."""
        self._check_loop()
        return await self._awaited(stream_id, self._submit_codes(stream_id, None, True, drop_incomplete_frame))

    async def _awaited(self, stream_id: int, future: asyncio.Future):
        try:
            return await future
        except asyncio.CancelledError:
            self.release(stream_id)
            raise

    def _new_future(self) -> asyncio.Future:
        return asyncio.get_running_loop().create_future()

    def _deliver(self, requests: list[_Request], results: list) -> None:
        if self._worker is None:  # on the loop's thread already
            for r, result in zip(requests, results):
                try:
                    self._resolve(r.future, result)
                except RuntimeError:  # closed after its loop ended: nobody waits
                    pass
            return
        by_loop: dict[asyncio.AbstractEventLoop, tuple[list, list]] = {}
        for r, result in zip(requests, results):
            if r.future is not None:
                futures, values = by_loop.setdefault(r.future.get_loop(), ([], []))
                futures.append(r.future)
                values.append(result)
        for loop, (futures, values) in by_loop.items():
            try:
                loop.call_soon_threadsafe(_resolve_all, futures, values)
            except RuntimeError:  # the loop closed: nobody waits
                pass

    def _check_loop(self) -> None:
        """Bind the running loop at the first push; refuse pushes from another one while the loop
        it is bound to still runs or has work of it queued (one ``asyncio.run`` after another, as
        scripts and notebooks do, moves it to the new loop)."""
        if self._worker is not None:
            return
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        if self._loop is not None:
            busy = self._pending or self._carried or self._queued_calls or self._in_flight
            if not self._loop.is_closed() and (self._loop.is_running() or busy):
                raise RuntimeError("this AsyncStreamBatcher runs its engine calls on the event loop of its first push; "
                                   "push from that loop, or make it with engine_thread=True to push from several")
            self._cancel_timers()
            self._pump_scheduled = False
        self._bind(loop)
        self._notify()  # what a closed loop left queued (releases of cancelled pushes) runs on this one

    async def __aenter__(self) -> "AsyncStreamBatcher":
        return self

    async def __aexit__(self, *exc) -> None:
        if self._worker is None:
            self.close()  # runs what is queued on this loop
        else:
            await asyncio.get_running_loop().run_in_executor(None, self.close)


class PCMBlock(Sequence):
    """One engine call's host PCM, end to end: ``pcm`` 1-D (int16 or float32), request j's audio
    ``pcm[offsets[j]:offsets[j + 1]]``. A sequence of those pieces (views); :meth:`span` takes
    consecutive ones at once without a Python step per piece."""

    def __init__(self, pcm: np.ndarray, offsets: np.ndarray) -> None:
        self.pcm, self.offsets = pcm, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, j: int) -> np.ndarray:
        if not 0 <= j < len(self):
            raise IndexError(j)
        return self.pcm[self.offsets[j]:self.offsets[j + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        bounds = self.offsets.tolist()
        return (self.pcm[a:b] for a, b in zip(bounds, bounds[1:]))

    def span(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Pieces ``start`` to ``stop - 1`` end to end, without a copy: (pcm 1-D, a view; offsets
        int64 [stop - start + 1] from 0)."""
        offsets = self.offsets[start:stop + 1]
        return self.pcm[offsets[0]:offsets[-1]], offsets - offsets[0]


def int16_pcm(audio: Tensor) -> Tensor:
    """Audio in [-1, 1] (any float dtype, any shape) as int16 PCM: scaled by 32767, rounded, clamped.
    Not in place: a float32 engine's audio is its own buffer."""
    return (audio.float() * 32767.0).round_().clamp_(-32768, 32767).to(torch.int16)


def _landed() -> bool:
    return True


def _streams_done(streams: list[_Stream], now: float) -> None:
    for stream in streams:  # idle time counts from a push's answer, not from its queueing
        stream.last_active, stream.done = now, stream.done + 1


def _resolve_all(futures: list, values: list) -> None:
    for future, value in zip(futures, values):
        _Batcher._resolve(future, value)


def freeze_startup_objects() -> None:
    """Call once a serving process has loaded and warmed up: every object alive then (torch, the
    model, the app: ~180k objects) leaves the garbage collector's reach (``gc.freeze``). Otherwise
    the first requests' new long-lived objects trigger full collections that scan them all, ~50-100
    ms with the interpreter held, and every stream of the process waits that long (the first clients
    after start-up, and after each new high of open streams). ``snac-fast serve`` and the engine
    process call it; a server built on :class:`AsyncStreamBatcher` should too."""
    gc.collect()
    gc.freeze()
