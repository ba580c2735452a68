"""A serving batcher with no engine thread (an experiment, not the product): the event loop's own
thread launches each engine call and polls its copy's CUDA event between its other callbacks, so no
second thread takes the GIL between the engine's CUDA calls. On the H100 hosts that stall every
~1.5 s, the engine's calls slowed several times more beside a second Python thread than alone
(docs/serving.md, "Host variance, probed further"); this measures whether a single-threaded server
escapes that: ``serve_stalls.py --inline`` runs the same load through it.

What it keeps of :class:`snac_fast.serving.AsyncStreamBatcher`: ``open``, ``push_ids`` (Orpheus ids,
one stream's pushes awaited in order), ``flush``, ``close``, host PCM (``output="int16"`` or
``"float32"``) copied once per engine call into pinned memory, two calls in flight (the next one
prepared while the GPU runs one), the counters ``bench_serve.py`` reads.
What it leaves out: cancellation, idle release, failure handling, the codes path, ``max_wait_ms``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque

import numpy as np
import torch

from snac_fast.orpheus import TokenLayout
from snac_fast.streaming import StreamEngine


class InlineBatcher:
    """Batches the pending pushes of many streams into one :meth:`StreamEngine.step_rows` call at a
    time, all on the running event loop's thread. ``records``: per engine call, (monotonic launch
    time, GPU ms, host ms from launch to delivery, rows, host ms of its parts, launch ms, 0.0), as
    ``serve_stalls.py`` records the threaded batcher's calls."""

    records: list[tuple] = []

    def __init__(self, engine: StreamEngine, max_batch: int = 64, max_wait_ms: float = 0.0,
                 layout: TokenLayout | None = None, output: str = "int16") -> None:
        if layout is None or output not in ("int16", "float32"):
            raise ValueError("the inline batcher takes Orpheus ids (layout=...) and gives host PCM (int16 or float32)")
        self.engine, self.max_batch, self.layout, self.output = engine, max_batch, layout, output
        self._streams: dict[int, tuple] = {}  # stream id -> (engine slot, token framer)
        self._ids = itertools.count()
        self._pending: list[tuple] = []  # (slot, level-major row, frames, future)
        self._in_flight: deque[tuple] = deque()  # launched calls, oldest first: at most two
        self._free: list[tuple] = []  # (timing events, pinned buffer) of calls delivered
        self._scheduled = self._polling = False
        self._cuda = engine.device.type == "cuda"
        self.batches = self.requests = 0
        self.gpu_seconds = self.step_seconds = 0.0

    def open(self, seed: int | None = None) -> int:
        stream_id = next(self._ids)
        self._streams[stream_id] = (self.engine.open(seed), self.layout.framer())
        return stream_id

    async def push_ids(self, stream_id: int, ids) -> np.ndarray:
        slot, framer = self._streams[stream_id]
        frames, row = framer.push_row(ids)
        if not frames:
            return np.empty(0, np.int16 if self.output == "int16" else np.float32)
        future = asyncio.get_running_loop().create_future()
        self._pending.append((slot, row, frames, future))
        if not self._scheduled and len(self._in_flight) < 2:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._launch)
        return await future

    async def flush(self, stream_id: int) -> np.ndarray:
        """Decode the rest of a stream and release it (synchronously, on this thread: once a stream)."""
        slot, framer = self._streams.pop(stream_id)
        framer.finish()
        audio = self.engine.advance({}, [slot])[slot]
        return self._pcm(audio).cpu().numpy()

    def close(self) -> None:
        for slot, _ in self._streams.values():
            self.engine.close(slot)
        self._streams.clear()

    def _pcm(self, audio: torch.Tensor) -> torch.Tensor:
        if self.output == "int16":
            return (audio.float() * 32767.0).round_().clamp_(-32768, 32767).to(torch.int16)
        return audio.float()

    def _launch(self) -> None:
        """Start engine calls while fewer than two are in flight (the host prepares the next call
        while the GPU runs one, as the threaded batcher does), and poll the oldest."""
        self._scheduled = False
        self._fill()
        if self._in_flight and not self._polling:
            self._polling = True
            self._poll()

    def _fill(self) -> None:
        while self._pending and len(self._in_flight) < 2:
            self._in_flight.append(self._start_call())

    def _start_call(self) -> tuple:
        """One engine call for the pending pushes of one frame count (a stream once), its PCM copy
        started into a pinned buffer of its own."""
        frames = self._pending[0][2]
        taken, kept, slots = [], [], set()
        for request in self._pending:
            if request[2] == frames and request[0] not in slots and len(taken) < self.max_batch:
                taken.append(request)
                slots.add(request[0])
            else:
                kept.append(request)
        self._pending = kept
        events, host = self._free.pop() if self._free else (
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self._cuda else None, None)
        launched, started = time.monotonic(), time.perf_counter()
        if self._cuda:
            events[0].record()
        audio, offsets = self.engine.step_rows([r[0] for r in taken], np.stack([r[1] for r in taken]), frames)
        stepped = time.perf_counter()
        pcm = self._pcm(audio)
        if self._cuda:
            if host is None or host.numel() < pcm.numel() or host.dtype != pcm.dtype:
                host = torch.empty(2 * pcm.numel(), dtype=pcm.dtype, pin_memory=True)
            host[:pcm.numel()].copy_(pcm, non_blocking=True)
            events[1].record()
        else:
            host = pcm
        done = time.perf_counter()
        parts = {"replay": 0.0, "inputs_wait": 0.0, "step_rows": (stepped - started) * 1e3, "to_host": (done - stepped) * 1e3}
        self.step_seconds += done - started
        return taken, events, host, offsets, launched, parts, (done - started) * 1e3

    def _poll(self) -> None:
        """Deliver the calls whose copies have landed, oldest first (one CUDA stream: they land in
        order); while one is still running, look again after the loop's other callbacks."""
        while self._in_flight:
            taken, events, host, offsets, launched, parts, launch_ms = self._in_flight[0]
            if self._cuda and not events[1].query():
                asyncio.get_running_loop().call_soon(self._poll)
                return
            self._in_flight.popleft()
            pcm = host.numpy()[:offsets[-1]].copy()
            for j, (_, _, _, future) in enumerate(taken):
                if not future.done():
                    future.set_result(pcm[offsets[j]:offsets[j + 1]])
            gpu_ms = events[0].elapsed_time(events[1]) if self._cuda else 0.0
            self.batches, self.requests = self.batches + 1, self.requests + len(taken)
            self.gpu_seconds += gpu_ms / 1e3
            self.records.append((launched, gpu_ms, (time.monotonic() - launched) * 1e3, len(taken), parts, launch_ms, 0.0))
            if self._cuda:
                self._free.append((events, host))
            self._fill()
        self._polling = False
