"""Where a serving process's streams decode: its own engine (:class:`InProcessBackend`) or an engine
process that every worker feeds (:class:`EngineProcessBackend`), behind one :class:`Backend`
protocol, so that the app and its routes never ask which."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from snac_fast.orpheus import TokenLayout
from snac_fast.serve.engine.client import EngineLostError
from snac_fast.serve.settings import EngineSettings

# an in-process server runs its engine calls on the event loop: any other thread that takes the GIL
# (an executor's, a library's) would hold the loop for up to the default 5 ms switch interval. This
# process is ours (a server): it may set the interval.
SWITCH_INTERVAL_S = 0.0005
# engine calls failed in a row, none run between, that make /health answer 503 "engine_failing": a
# device that fails every call (a sticky CUDA error) gets its server restarted; a lone out-of-memory
# step does not
FAILING_CALLS = 8


@dataclass
class Health:
    """What /health reports of the backend."""

    status: str  # "ok", "engine_lost" or "engine_failing"
    slots_in_use: int  # of every worker, where an engine process serves several
    error: str | None = None  # the last engine failure, when failing
    memory: dict | None = None  # the engine's GPU memory in bytes (snac_fast.serve.engine.gpu_memory.memory_readings)


class Backend(Protocol):
    """A serving process's decode side: streams of LM token ids in, float32 PCM out.

    ``device`` (its name), ``max_streams``, ``rate`` (Hz) and ``samples_per_frame`` describe it;
    :meth:`open` gives None when every slot is taken; :meth:`push` and :meth:`flush` raise
    ValueError for a bad id or an ended stream, RuntimeError when the engine call failed
    (:class:`EngineLostError`: the engine process is gone)."""

    device: str
    max_streams: int
    rate: int
    samples_per_frame: int

    async def open(self, seed: int | None) -> int | None: ...

    async def push(self, stream_id: int, ids) -> np.ndarray: ...

    async def flush(self, stream_id: int, *, drop_incomplete_frame: bool = False) -> np.ndarray: ...

    def release(self, stream_id: int) -> None: ...

    def is_open(self, stream_id: int) -> bool: ...

    @property
    def open_streams(self) -> int:
        """This worker's open streams."""

    async def health(self) -> Health: ...

    async def metric_values(self) -> dict[str, float]:
        """The counters and gauges of :data:`snac_fast.serve.metrics.BACKEND_METRICS` it has."""

    async def close(self) -> None: ...


class InProcessBackend:
    """The codec's shared stream engine behind an :class:`~snac_fast.serve.AsyncStreamBatcher` whose
    engine calls run on this process's event loop (``engine_calls="thread"``: on a thread of their own)."""

    def __init__(self, codec, settings: EngineSettings, layout: TokenLayout) -> None:
        layout.check_model(codec.config)
        from snac_fast.batching.batchers import AsyncStreamBatcher
        from snac_fast.serve.engine.gpu_memory import memory_readings

        self.memory_readings = memory_readings
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.engine = codec.shared_stream_engine(settings.lookahead, max_streams=settings.max_streams)
        self.device, self.max_streams = str(codec.device), self.engine.max_streams
        self.rate, self.samples_per_frame = int(codec.config["sampling_rate"]), self.engine.samples_per_frame
        self.batcher = AsyncStreamBatcher(self.engine, max_batch=settings.max_batch, max_wait_ms=settings.max_wait_ms,
                                          layout=layout, output="float32", idle_timeout_s=settings.idle_timeout_s,
                                          engine_thread=not settings.calls_on_loop(engine_process=False))

    async def open(self, seed: int | None) -> int | None:
        if self.engine.open_streams >= self.engine.max_streams:
            return None
        try:
            return self.batcher.open(seed)
        except RuntimeError:  # all slots taken (between the look and the open)
            return None

    async def push(self, stream_id: int, ids) -> np.ndarray:
        return await self.batcher.push_ids(stream_id, ids)

    async def flush(self, stream_id: int, *, drop_incomplete_frame: bool = False) -> np.ndarray:
        return await self.batcher.flush(stream_id, drop_incomplete_frame=drop_incomplete_frame)

    def release(self, stream_id: int) -> None:
        self.batcher.release(stream_id)

    def is_open(self, stream_id: int) -> bool:
        return self.batcher.is_open(stream_id)

    @property
    def open_streams(self) -> int:
        return self.batcher.open_streams

    async def health(self) -> Health:
        b = self.batcher
        failing = b.failed_in_a_row >= FAILING_CALLS
        return Health("engine_failing" if failing else "ok", self.engine.open_streams, b.last_failure if failing else None,
                      self.memory_readings(self.engine.device))

    async def metric_values(self) -> dict[str, float]:
        b = self.batcher
        return {"active_streams": b.open_streams, "queue_depth": b.queued, "steps": b.batches,
                "step_requests": b.requests, "step_seconds": b.step_seconds, "failed_steps": b.failed_calls,
                "failed_steps_in_a_row": b.failed_in_a_row, "idle_released": b.idle_released,
                **self.memory_readings(self.engine.device)}

    async def close(self) -> None:
        self.batcher.close()  # runs what is queued on this loop


class EngineProcessBackend:
    """An :class:`~snac_fast.serve.engine.client.EngineClient` to the engine process at ``address``
    (``info``: what it told of itself), made in the event loop that uses it. Its counters are the
    engine process's, read at each health check and metrics scrape."""

    def __init__(self, address: str, info: dict, layout: TokenLayout) -> None:
        layout.check_model(info["config"])
        self.address, self.layout = address, layout
        self.device, self.max_streams = info["device"], info["max_streams"]
        self.rate, self.samples_per_frame = int(info["config"]["sampling_rate"]), info["samples_per_frame"]
        self._client = None
        self.stats = {"open_streams": 0, "batches": 0, "requests": 0, "failed_calls": 0, "failed_in_a_row": 0,
                      "last_failure": None, "step_seconds": 0.0}

    def client(self):
        """The client, made in the event loop that uses it (its replies are resolved there)."""
        if self._client is None:
            from snac_fast.serve.engine.client import EngineClient

            try:
                self._client = EngineClient(self.address, self.layout)
            except OSError as e:  # its socket refuses: the process is gone
                raise EngineLostError(f"cannot reach the engine process at {self.address}: {e}") from None
        return self._client

    @property
    def lost(self) -> EngineLostError | None:
        """Why the engine process cannot be reached, once it cannot."""
        return None if self._client is None else self._client.lost

    async def open(self, seed: int | None) -> int | None:
        try:
            return await self.client().open(seed)
        except EngineLostError:
            raise
        except RuntimeError:  # all slots taken
            return None

    async def push(self, stream_id: int, ids) -> np.ndarray:
        return await self.client().push_ids(stream_id, ids)

    async def flush(self, stream_id: int, *, drop_incomplete_frame: bool = False) -> np.ndarray:
        return await self.client().flush(stream_id, drop_incomplete_frame=drop_incomplete_frame)

    def release(self, stream_id: int) -> None:
        if self._client is not None:
            self._client.release(stream_id)

    def is_open(self, stream_id: int) -> bool:
        return self._client is not None and self._client.is_open(stream_id)

    @property
    def open_streams(self) -> int:
        return 0 if self._client is None else self._client.open_streams

    async def refresh(self) -> None:
        """Read the engine process's counters (raises EngineLostError once it is gone)."""
        self.stats.update(await self.client().stats())

    async def health(self) -> Health:
        try:
            await self.refresh()
        except EngineLostError:
            return Health("engine_lost", self.stats["open_streams"])
        failing = self.stats["failed_in_a_row"] >= FAILING_CALLS
        return Health("engine_failing" if failing else "ok", self.stats["open_streams"],
                      self.stats["last_failure"] if failing else None, self.stats.get("memory"))

    async def metric_values(self) -> dict[str, float]:
        try:  # else the last counters read, and engine_up 0
            await self.refresh()
        except EngineLostError:
            pass
        s = self.stats
        return {"engine_up": float(self.lost is None), "active_streams": s["open_streams"], "steps": s["batches"],
                "step_requests": s["requests"], "step_seconds": s["step_seconds"], "failed_steps": s["failed_calls"],
                "failed_steps_in_a_row": s["failed_in_a_row"], **(s.get("memory") or {})}

    async def close(self) -> None:
        if self._client is not None:
            self._client.close()
