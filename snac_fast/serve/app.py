"""The speech server's Starlette app: one :class:`SpeechServer` per process (a backend, the LM
client, metrics) in ``app.state.server``, and thin routes that fetch it from there.

Routes: ``POST /v1/audio/speech`` (:mod:`snac_fast.serve.speech`), ``WS /v1/audio/stream``
(:mod:`snac_fast.serve.websocket`), ``GET /health``, ``GET /metrics`` (Prometheus text).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np

from snac_fast.serve.backend import Backend, EngineProcessBackend, InProcessBackend
from snac_fast.serve.batchers import freeze_startup_objects
from snac_fast.serve.lm_client import LMClient
from snac_fast.serve.metrics import ServeMetrics
from snac_fast.serve.settings import ServeSettings
from snac_fast.serve.speech import pcm_bytes, speech
from snac_fast.serve.websocket import stream_ids

DRAIN_S = 30.0  # a graceful shutdown waits this long for open streams to end


class SpeechServer:
    """The state of one serving process: its backend, an HTTP client for the LM, metrics."""

    def __init__(self, backend: Backend, settings: ServeSettings) -> None:
        self.backend, self.settings = backend, settings
        self.frame_seconds = backend.samples_per_frame / backend.rate
        self.metrics = ServeMetrics(self.frame_seconds, backend.max_streams)
        self.draining = False
        self.lm = LMClient(settings)

    async def open_stream(self, seed: int | None) -> int | None:
        """A stream id, or None when the engine is full or the server is shutting down."""
        if self.draining:
            return None
        return await self.backend.open(seed)

    async def push(self, sid: int, ids) -> np.ndarray:
        start = time.perf_counter()
        audio = await self.backend.push(sid, ids)
        if audio.size:
            self.metrics.observe_push(time.perf_counter() - start)
        return audio

    async def warm_up(self, frames: int = 8) -> None:
        """Before the first request, each part of the request path once: the LM client's
        (:meth:`LMClient.warm_up`), a streaming response, and one silent stream through this
        worker's decode path (open, pushes of one frame of ids, flush). Otherwise the first
        requests pay for that first-time work (docs/server.md)."""
        await self.lm.warm_up()
        from starlette.responses import StreamingResponse

        # a streaming response sent nowhere: anyio's task group and streams first used here, not at a
        # client's first audio
        await _send_nowhere(StreamingResponse(_one(pcm_bytes(np.zeros(16, np.float32), "s16")), media_type="audio/pcm"))
        layout = self.settings.layout
        frame = layout.offset + np.arange(layout.frame_size, dtype=np.int64) * layout.codebook_size  # code 0 each
        sid = await self.open_stream(seed=0)
        if sid is None:
            return
        try:
            for _ in range(frames):
                await self.backend.push(sid, frame)
            await self.backend.flush(sid)
        except BaseException:
            self.backend.release(sid)
            raise

    async def close(self) -> None:
        """Graceful shutdown: no new streams, then wait (up to :data:`DRAIN_S`) for the open ones to end."""
        self.draining = True
        deadline = time.monotonic() + DRAIN_S
        while self.backend.open_streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.backend.close()
        await self.lm.aclose()


async def health(request):
    from starlette.responses import JSONResponse

    server: SpeechServer = request.app.state.server
    state = await server.backend.health()
    status = state.status if state.status == "engine_lost" or not server.draining else "draining"
    body = {"status": status, "device": server.backend.device, "open_streams": server.backend.open_streams,
            "slots_in_use": state.slots_in_use, "max_streams": server.backend.max_streams,
            "sampling_rate": server.backend.rate}
    if status == "engine_failing":
        body["error"] = state.error
    return JSONResponse(body, status_code=200 if status == "ok" else 503)


async def metrics(request):
    from prometheus_client import CONTENT_TYPE_LATEST
    from starlette.responses import Response

    server: SpeechServer = request.app.state.server
    server.metrics.backend_values = await server.backend.metric_values()
    return Response(server.metrics.text(), media_type=CONTENT_TYPE_LATEST)


def create_app(codec=None, settings: ServeSettings | None = None, engine: tuple[str, dict] | None = None):
    """The Starlette app serving ``codec`` (a :class:`~snac_fast.FastSNAC`) with ``settings``; or,
    with ``engine`` (an :class:`~snac_fast.serve.EngineProcess`'s ``address`` and ``info``) and no
    codec, feeding that engine process, which other workers share."""
    from starlette.applications import Starlette
    from starlette.routing import Route, WebSocketRoute

    settings = (settings or ServeSettings()).check()
    if (codec is None) == (engine is None):
        raise ValueError("create_app takes a codec or an engine process's (address, info), one of them")
    backend = InProcessBackend(codec, settings) if engine is None else EngineProcessBackend(*engine, settings.layout)
    server = SpeechServer(backend, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await server.warm_up()
        freeze_startup_objects()
        yield
        await server.close()

    app = Starlette(routes=[Route("/v1/audio/speech", speech, methods=["POST"]),
                            WebSocketRoute("/v1/audio/stream", stream_ids),
                            Route("/health", health), Route("/metrics", metrics)], lifespan=lifespan)
    app.state.server = server
    return app


async def _one(item):
    yield item


async def _send_nowhere(response) -> None:
    """Run a Starlette response as uvicorn does (ASGI spec 2.3: a task group that also listens for
    the client's disconnect), its messages dropped."""
    finished = asyncio.Event()

    async def receive() -> dict:
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            finished.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "path": "/", "headers": []}
    await response(scope, receive, send)
