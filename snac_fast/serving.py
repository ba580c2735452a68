"""Batching of concurrent streams for servers: what TTS servers hand-write around ``SNAC.decode``
(collect the requests of many streams, wait at most a few ms or until the batch is full, decode them
together), here over an exact :class:`~snac_fast.streaming.StreamEngine`.

:class:`StreamBatcher` is the thread-safe synchronous form: one worker thread runs the GPU work;
``push`` blocks its caller until that stream's audio is ready (``submit`` returns a
``concurrent.futures.Future`` instead). :class:`AsyncStreamBatcher` is the asyncio form over the same
worker: ``await batcher.push(stream_id, codes)``; the event loop never waits on the GPU.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Sequence

from torch import Tensor

from snac_fast.orpheus import TokenFramer, TokenLayout
from snac_fast.streaming import StreamEngine, StreamSlot


@dataclass
class _Request:
    stream: StreamSlot
    codes: list[Tensor] | None  # checked, or None for a flush alone
    finish: bool
    future: Future = field(default_factory=Future)


class StreamBatcher:
    """Runs the pushes of many streams in batches on one engine.

    max_batch: most requests per engine call (SNAC_MAX_BATCH in servers); max_wait_ms: how long the
    first request of a batch waits for others (SNAC_BATCH_TIMEOUT_MS). layout: token layout for
    :meth:`push_ids` (:data:`snac_fast.orpheus.ORPHEUS`). A stream's requests run in the order they
    were submitted; a bad request fails its own future (or raises in the caller) and no other.
    Use as a context manager, or call :meth:`close` to stop the worker.
    """

    def __init__(self, engine: StreamEngine, max_batch: int = 64, max_wait_ms: float = 5.0,
                 layout: TokenLayout | None = None) -> None:
        if max_batch < 1 or max_wait_ms < 0:
            raise ValueError("max_batch must be >= 1 and max_wait_ms >= 0")
        if layout is not None:
            layout.check_model(engine.config)
        self.engine, self.max_batch, self.max_wait = engine, max_batch, max_wait_ms / 1000.0
        self.layout = layout
        self._streams: dict[int, StreamSlot] = {}
        self._framers: dict[int, TokenFramer] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._closed = False
        self._worker = threading.Thread(target=self._serve, name="snac-fast-batcher", daemon=True)
        self._worker.start()
        self.batches = 0  # engine calls so far (for monitoring)

    # -- streams -------------------------------------------------------------------------------

    def open(self, seed: int | None = None) -> int:
        """A new stream's id (its noise seed: see :meth:`StreamEngine.open`)."""
        slot = self.engine.open(seed)
        with self._lock:
            stream_id, self._next_id = self._next_id, self._next_id + 1
            self._streams[stream_id] = slot
            if self.layout is not None:
                self._framers[stream_id] = self.layout.framer()
        return stream_id

    def _stream(self, stream_id: int) -> StreamSlot:
        with self._lock:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            if stream_id not in self._streams:
                raise ValueError(f"no open stream {stream_id!r}")
            return self._streams[stream_id]

    def submit(self, stream_id: int, codes: Sequence[Tensor] | None = None, *, finish: bool = False) -> Future:
        """Queue new codes (k >= 1 frames, checked now) and/or the stream's end; the future's result
        is the stream's audio that became final (1-D tensor on the engine's device)."""
        stream = self._stream(stream_id)
        checked = self.engine.check_codes(codes) if codes is not None else None
        if finish:
            with self._lock:
                self._streams.pop(stream_id, None)
                framer = self._framers.pop(stream_id, None)
            if framer is not None:
                framer.finish()
        request = _Request(stream, checked, finish)
        self._queue.put(request)
        return request.future

    def submit_ids(self, stream_id: int, ids) -> Future:
        """Queue raw LM token ids (checked now; an incomplete frame waits for the next push)."""
        stream = self._stream(stream_id)
        framer = self._framers.get(stream_id)
        if framer is None:
            raise ValueError("this batcher has no token layout: make it with layout=... (snac_fast.orpheus)")
        codes = framer.push(ids)
        if codes is None:
            done: Future = Future()
            done.set_result(self.engine.empty_audio())
            return done
        request = _Request(stream, self.engine.check_codes(codes), False)
        self._queue.put(request)
        return request.future

    def push(self, stream_id: int, codes: Sequence[Tensor]) -> Tensor:
        return self.submit(stream_id, codes).result()

    def push_ids(self, stream_id: int, ids) -> Tensor:
        return self.submit_ids(stream_id, ids).result()

    def flush(self, stream_id: int) -> Tensor:
        """End the stream: the rest of its audio."""
        return self.submit(stream_id, finish=True).result()

    # -- the worker ----------------------------------------------------------------------------

    def _collect(self, first: _Request, carried: deque) -> tuple[list[_Request], bool]:
        batch, stopping = [first], False
        deadline = time.monotonic() + self.max_wait
        while len(batch) < self.max_batch:
            if carried:
                batch.append(carried.popleft())
                continue
            timeout = deadline - time.monotonic()
            try:
                request = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if request is None:
                stopping = True
                break
            batch.append(request)
        return batch, stopping

    def _serve(self) -> None:
        carried: deque[_Request] = deque()  # a stream's later requests wait for its earlier one
        while True:
            first = carried.popleft() if carried else self._queue.get()
            if first is None:
                return
            batch, stopping = self._collect(first, carried)
            now, seen = [], set()
            for request in batch:
                if request.stream in seen:
                    carried.append(request)
                else:
                    seen.add(request.stream)
                    now.append(request)
            self._run(now)
            if stopping:
                while carried:
                    self._run([carried.popleft()])
                return

    def _run(self, requests: list[_Request]) -> None:
        pushes = {r.stream: r.codes for r in requests if r.codes is not None}
        finish = [r.stream for r in requests if r.finish]
        try:
            audio = self.engine.advance(pushes, finish)
        except ValueError as error:  # a request the engine refused before any work: find it alone
            if len(requests) > 1:
                for r in requests:
                    self._run([r])
                return
            requests[0].future.set_exception(error)
            return
        except BaseException as error:  # noqa: BLE001 - handed to every waiting caller
            for r in requests:
                r.future.set_exception(error)
            return
        self.batches += 1
        for r in requests:
            r.future.set_result(audio[r.stream])

    def close(self) -> None:
        """Finish the queued requests, then stop the worker (open streams are released)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            streams = list(self._streams.values())
            self._streams.clear()
        self._queue.put(None)
        self._worker.join()
        for s in streams:
            self.engine.close(s)

    def __enter__(self) -> "StreamBatcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncStreamBatcher:
    """The asyncio form: ``await push(stream_id, codes)`` returns that stream's audio; pushes of
    concurrent tasks are batched (``max_batch``, ``max_wait_ms``) by a worker thread."""

    def __init__(self, engine: StreamEngine, max_batch: int = 64, max_wait_ms: float = 5.0,
                 layout: TokenLayout | None = None) -> None:
        self.sync = StreamBatcher(engine, max_batch, max_wait_ms, layout)

    def open(self, seed: int | None = None) -> int:
        return self.sync.open(seed)

    async def push(self, stream_id: int, codes: Sequence[Tensor]) -> Tensor:
        return await asyncio.wrap_future(self.sync.submit(stream_id, codes))

    async def push_ids(self, stream_id: int, ids) -> Tensor:
        return await asyncio.wrap_future(self.sync.submit_ids(stream_id, ids))

    async def flush(self, stream_id: int) -> Tensor:
        return await asyncio.wrap_future(self.sync.submit(stream_id, finish=True))

    def close(self) -> None:
        self.sync.close()

    async def __aenter__(self) -> "AsyncStreamBatcher":
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)
