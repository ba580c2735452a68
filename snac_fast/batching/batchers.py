"""Batching of concurrent streams for servers: many streams' pushes decoded together on one
:class:`~snac_fast.streaming.StreamEngine`.

:class:`AsyncStreamBatcher` is the asyncio form (``await batcher.push_ids(stream_id, ids)``),
:class:`StreamBatcher` the thread-safe blocking one (``push`` waits; ``submit`` returns a
``concurrent.futures.Future``). Both are the same rounds (:mod:`snac_fast.batching.rounds`) with a
driver (:mod:`snac_fast.batching.drivers`), built for the host to keep up with the GPU:

- A push is checked and framed on the caller's thread with numpy alone (ids to codes, no torch
  call), then appended to a deque (no lock).
- The engine calls run on one thread: :class:`StreamBatcher`'s engine thread, or by default
  :class:`AsyncStreamBatcher`'s event loop itself, between its other callbacks. Whatever is pending
  when the GPU frees runs in chunks of ``max_batch`` streams, one :meth:`StreamEngine.step_rows`
  each, two calls in flight, each call's results handed out at once.
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
from collections.abc import Sequence
from concurrent.futures import Future

from torch import Tensor

from snac_fast.batching.defaults import LIBRARY_MAX_BATCH, LIBRARY_MAX_WAIT_MS
from snac_fast.batching.drivers import LoopDriver, ThreadDriver
from snac_fast.batching.futures import resolve, resolve_all
from snac_fast.batching.rounds import BatchRounds, Request
from snac_fast.orpheus import TokenLayout
from snac_fast.streaming import StreamEngine


class StreamBatcher(BatchRounds):
    """Runs the pushes of many streams in batches on one engine, for threads.

    max_batch: most streams per engine call (larger batches run in several calls); max_wait_ms: while
    fewer than max_batch requests are pending, rounds of engine calls start at most this often, a
    stream's first audio at once (0: whatever is pending when the GPU frees). layout: token layout for :meth:`push_ids`
    (:data:`snac_fast.orpheus.ORPHEUS`). output: ``"tensor"`` (1-D GPU tensors in the engine's
    dtype), ``"float32"`` or ``"int16"`` (1-D numpy PCM). idle_timeout_s: release a stream no push
    touched for that long. A stream's requests run in order; a bad request fails its own future (or
    raises in the caller) and no other. Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, engine: StreamEngine, max_batch: int = LIBRARY_MAX_BATCH,
                 max_wait_ms: float = LIBRARY_MAX_WAIT_MS, layout: TokenLayout | None = None, output: str = "tensor",
                 idle_timeout_s: float | None = None) -> None:
        super().__init__(engine, max_batch, max_wait_ms, layout, output, idle_timeout_s)
        self.driver = ThreadDriver(self)

    def submit(self, stream_id: int, codes: Sequence[Tensor] | None = None, *, finish: bool = False) -> Future:
        """Queue new codes (k >= 1 frames, checked now) and/or the stream's end; the future's result
        is the stream's audio that became final."""
        return self.submit_codes(stream_id, codes, finish)

    def push(self, stream_id: int, codes: Sequence[Tensor]):
        return self.submit(stream_id, codes).result()

    def push_ids(self, stream_id: int, ids):
        return self.submit_ids(stream_id, ids).result()

    def flush(self, stream_id: int, *, drop_incomplete_frame: bool = False):
        """End the stream: the rest of its audio. ``drop_incomplete_frame``: ids of a frame left
        incomplete (an LM cut off mid-frame) are dropped instead of raising ValueError."""
        return self.submit_codes(stream_id, None, True, drop_incomplete_frame).result()

    def new_future(self) -> Future:
        return Future()

    def deliver(self, requests: list[Request], results: list) -> None:
        for r, result in zip(requests, results):
            try:
                resolve(r.future, result)
            except Exception:  # noqa: BLE001 - cancelled by its caller in between: nobody waits
                pass

    def __enter__(self) -> "StreamBatcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncStreamBatcher(BatchRounds):
    """The asyncio form: ``await push_ids(stream_id, ids)`` (or ``push`` of codes) returns that
    stream's audio that became final; options as :class:`StreamBatcher`. Cancelling an awaiting task
    (a client that disconnected) releases its stream and nothing else.

    engine_thread: ``False`` (the default): the engine calls run on the event loop's own thread,
    between its other callbacks (:class:`~snac_fast.batching.drivers.LoopDriver`): no second thread
    takes the interpreter between the engine's CUDA calls, which on some hosts stalls them for tens
    of milliseconds (docs/batching.md). Every push must then come from one event loop (the first that
    pushes; once it has closed, the next one), and :meth:`close` runs what is queued on it.
    ``True``: a thread of the batcher runs the engine calls (pushes from any event loops), results
    reach each loop in one wake-up per engine call.
    """

    def __init__(self, engine: StreamEngine, max_batch: int = LIBRARY_MAX_BATCH,
                 max_wait_ms: float = LIBRARY_MAX_WAIT_MS, layout: TokenLayout | None = None, output: str = "tensor",
                 idle_timeout_s: float | None = None, *, engine_thread: bool = False) -> None:
        super().__init__(engine, max_batch, max_wait_ms, layout, output, idle_timeout_s)
        self.engine_thread = engine_thread
        self.driver = ThreadDriver(self) if engine_thread else LoopDriver(self)

    def open(self, seed: int | None = None) -> int:
        if not self.engine_thread and self.driver.loop is None:
            try:
                self.driver.bind(asyncio.get_running_loop())  # idle release counts from now
            except RuntimeError:  # opened outside a loop: bound at the first push
                pass
        return super().open(seed)

    async def push(self, stream_id: int, codes: Sequence[Tensor]):
        self._check_loop()
        return await self._awaited(stream_id, self.submit_codes(stream_id, codes, False))

    async def push_ids(self, stream_id: int, ids):
        self._check_loop()
        return await self._awaited(stream_id, self.submit_ids(stream_id, ids))

    async def flush(self, stream_id: int, *, drop_incomplete_frame: bool = False):
        """End the stream: the rest of its audio (``drop_incomplete_frame``: as :meth:`StreamBatcher.flush`)."""
        self._check_loop()
        return await self._awaited(stream_id, self.submit_codes(stream_id, None, True, drop_incomplete_frame))

    async def _awaited(self, stream_id: int, future: asyncio.Future):
        try:
            return await future
        except asyncio.CancelledError:
            self.release(stream_id)
            raise

    def new_future(self) -> asyncio.Future:
        return asyncio.get_running_loop().create_future()

    def deliver(self, requests: list[Request], results: list) -> None:
        if not self.engine_thread:  # on the loop's thread already
            for r, result in zip(requests, results):
                try:
                    resolve(r.future, result)
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
                loop.call_soon_threadsafe(resolve_all, futures, values)
            except RuntimeError:  # the loop closed: nobody waits
                pass

    def _check_loop(self) -> None:
        """Bind the running loop at the first push; refuse pushes from another one while the loop
        it is bound to still runs or has work of it queued (one ``asyncio.run`` after another, as
        scripts and notebooks do, moves it to the new loop)."""
        if self.engine_thread:
            return
        loop, driver = asyncio.get_running_loop(), self.driver
        if loop is driver.loop:
            return
        if driver.loop is not None and not driver.loop.is_closed() and (driver.loop.is_running() or driver.busy):
            raise RuntimeError("this AsyncStreamBatcher runs its engine calls on the event loop of its first push; "
                               "push from that loop, or make it with engine_thread=True to push from several")
        driver.bind(loop)
        driver.notify()  # what a closed loop left queued (releases of cancelled pushes) runs on this one

    async def __aenter__(self) -> "AsyncStreamBatcher":
        return self

    async def __aexit__(self, *exc) -> None:
        if not self.engine_thread:
            self.close()  # runs what is queued on this loop
        else:
            await asyncio.get_running_loop().run_in_executor(None, self.close)


def freeze_startup_objects() -> None:
    """Call once a serving process has loaded and warmed up: every object alive then (torch, the
    model, the app: ~180k objects) leaves the garbage collector's reach (``gc.freeze``). Otherwise
    the first requests' new long-lived objects trigger full collections that scan them all, ~50-100
    ms with the interpreter held, and every stream of the process waits that long (the first clients
    after start-up, and after each new high of open streams). ``snac-fast serve`` and the engine
    process call it; a server built on :class:`AsyncStreamBatcher` should too."""
    gc.collect()
    gc.freeze()
