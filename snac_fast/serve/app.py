"""The speech server's Starlette app: one :class:`SpeechServer` per process (a backend, the LM
client, metrics) in ``app.state.server``, and thin routes that fetch it from there.

Routes: ``GET /`` (a page to try it, :mod:`snac_fast.serve.routes.page`), ``POST /v1/audio/speech``
(:mod:`snac_fast.serve.routes.openai_speech`), ``POST /v1/text-to-speech/{voice_id}[/stream][/with-timestamps]`` (ElevenLabs',
:mod:`snac_fast.serve.routes.elevenlabs_speech`), ``WS /v1/text-to-speech/{voice_id}/stream-input`` and
``.../multi-stream-input`` (text in, :mod:`snac_fast.serve.routes.text_stream`,
:mod:`snac_fast.serve.routes.text_contexts`), ``WS /v1/audio/stream`` (ids in,
:mod:`snac_fast.serve.routes.ids_stream`), ``GET /v1/audio/voices``, ``GET /v1/models``, ``GET /health``
(liveness: the process and its engine), ``GET /ready`` (readiness: the engine and the LM answer),
``GET /metrics`` (Prometheus text). With an API key, every route but ``/health`` and ``/`` needs it
(:mod:`snac_fast.serve.access.auth`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import numpy as np

from snac_fast.batching.batchers import freeze_startup_objects
from snac_fast.runtime.host_memory import trim_periodically
from snac_fast.serve.access.auth import DOCS_PREFIX, BearerKey, OriginCheck
from snac_fast.serve.access.limits import BodyLimit, StreamOwners
from snac_fast.serve.engine.backend import Backend, EngineProcessBackend, InProcessBackend
from snac_fast.serve.lm.client import LMClient, redacted_url
from snac_fast.serve.lm.presets import choose_preset
from snac_fast.serve.metrics import ServeMetrics
from snac_fast.serve.routes.elevenlabs_speech import text_to_speech
from snac_fast.serve.routes.ids_stream import stream_ids
from snac_fast.serve.routes.openai_speech import speech
from snac_fast.serve.routes.page import page
from snac_fast.serve.routes.protocol import OPENAI_MODELS, models_list, voices_list
from snac_fast.serve.routes.schema import openapi_document
from snac_fast.serve.routes.text_contexts import multi_stream_input
from snac_fast.serve.routes.text_stream import stream_input
from snac_fast.serve.services.formats import FORMATS, StreamEncoder, pcm_bytes
from snac_fast.serve.settings import ServeSettings

log = logging.getLogger("snac_fast.serve")
DRAIN_S = 30.0  # a graceful shutdown waits this long for open streams to end
LM_PROBE_S = 2.0  # /health and /ready ask the LM at most this often


class SpeechServer:
    """The state of one serving process: its backend, an HTTP client for the LM, metrics."""

    def __init__(self, backend: Backend, settings: ServeSettings) -> None:
        self.backend, self.settings = backend, settings
        self.frame_seconds = backend.samples_per_frame / backend.rate
        self.metrics = ServeMetrics(self.frame_seconds, backend.max_streams)
        self.draining = False
        self.owners = StreamOwners(settings.http.max_streams_per_key)
        self.lm = LMClient(settings.lm, settings.layout, settings.engine.max_streams)
        self.voices = settings.lm.voices_of(self.lm.preset)  # the preset found at start-up replaces the named one
        self._lm_state: tuple[float, str, str | None] = (-LM_PROBE_S, "not_configured", None)

    async def find_preset(self) -> None:
        """The LM's preset (:func:`~snac_fast.serve.lm.presets.choose_preset`): ``--lm-preset``, else
        the one its model name matches; said in the log. ValueError when ``--voice`` is not one of
        its voices."""
        named = self.settings.lm.lm_preset
        if named is None and self.settings.lm.lm_url is None:
            return  # no LM to ask: the Orpheus preset, as named in the settings
        model = None if named is not None else await self.lm.model_name()
        preset, why = choose_preset(model, named)
        self.settings.lm.check_voice(preset)
        self.lm.preset, self.voices = preset, self.settings.lm.voices_of(preset)
        log.info("LM preset %s (%s): %s", preset.name, preset.title, why)

    async def lm_state(self) -> tuple[str, str | None]:
        """Whether the LM answers (:meth:`LMClient.probe`), asked at most every :data:`LM_PROBE_S`."""
        asked, status, why = self._lm_state
        if time.monotonic() - asked >= LM_PROBE_S:
            status, why = await self.lm.probe()
            self._lm_state = (time.monotonic(), status, why)
        return status, why

    async def open_stream(self, seed: int | None, client: str = "server") -> int | None:
        """A stream id, or None when the engine is full or the server is shutting down;
        :class:`~snac_fast.serve.access.limits.TooManyStreams` when ``client`` holds its most already.
        Every stream opened here ends with :meth:`stream_ended`."""
        if self.draining:
            return None
        self.owners.check(client)
        sid = await self.backend.open(seed)
        if sid is not None:
            self.owners.add(sid, client)
        return sid

    def stream_ended(self, sid: int, release: bool = False) -> None:
        """A stream is over, however it ended: its client's count goes down; ``release``: free its
        slot if it is still open (an error, a client gone)."""
        self.owners.done(sid)
        if release and self.backend.is_open(sid):
            self.backend.release(sid)

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
        requests pay for that first-time work (docs/http_server.md)."""
        await self.find_preset()
        await self.lm.warm_up()
        from starlette.responses import StreamingResponse

        # a streaming response sent nowhere: anyio's task group and streams first used here, not at a
        # client's first audio
        await _send_nowhere(StreamingResponse(_one(pcm_bytes(np.zeros(16, np.float32), "s16")), media_type="audio/pcm"))
        encoder = StreamEncoder(FORMATS["mp3"], self.backend.rate)  # FFmpeg loaded, the default format's first use
        encoder.encode(np.zeros(self.backend.samples_per_frame, np.float32))
        encoder.finish()
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
            self.stream_ended(sid, release=True)
            raise
        self.stream_ended(sid)

    async def close(self) -> None:
        """Graceful shutdown: no new streams, then wait (up to :data:`DRAIN_S`) for the open ones to end."""
        self.draining = True
        deadline = time.monotonic() + DRAIN_S
        while self.backend.open_streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.backend.close()
        await self.lm.aclose()


async def _health_body(server: SpeechServer, details: bool = True) -> dict:
    """The health answer; without ``details``, its status alone (the LM is not asked)."""
    state = await server.backend.health()
    status = state.status if state.status == "engine_lost" or not server.draining else "draining"
    if not details:
        return {"status": status}
    lm, why = await server.lm_state()
    body = {"status": status, "device": server.backend.device, "pid": os.getpid(), "open_streams": server.backend.open_streams,
            "slots_in_use": state.slots_in_use, "max_streams": server.backend.max_streams,
            "sampling_rate": server.backend.rate,
            "lm": {"status": lm, "url": redacted_url(server.settings.lm.lm_url) if server.settings.lm.lm_url else None,
                   "preset": server.lm.preset.name}}
    if why:
        body["lm"]["error"] = why
    if state.memory:
        body["gpu_memory"] = {k.removeprefix("gpu_").replace("_bytes", "_gb"): round(v / 1e9, 3) for k, v in state.memory.items()}
    if server.settings.engine.gpu_memory_gb:
        body.setdefault("gpu_memory", {})["budget_gb"] = server.settings.engine.gpu_memory_gb
    if status == "engine_failing":
        body["error"] = state.error
    return body


async def health(request):
    """Liveness: 200 while this process and its engine serve (the LM's state is reported, not judged).
    Open to anyone, so it says only ``status`` without the key; the details (pid, streams, the LM's
    state and error, memory) go to requests with the key, or to all on a server without one."""
    from starlette.responses import JSONResponse

    server = request.app.state.server
    keyed = (request.scope.get("state") or {}).get("client", "").startswith("key ")
    body = await _health_body(server, details=keyed or not server.settings.http.api_key)
    return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)


async def ready(request):
    """Readiness: 200 only when the engine serves and the LM answers (a load balancer's check)."""
    from starlette.responses import JSONResponse

    body = await _health_body(request.app.state.server)
    ok = body["status"] == "ok" and body["lm"]["status"] == "ok"
    return JSONResponse({**body, "ready": ok}, status_code=200 if ok else 503)


async def voices(request):
    from starlette.responses import JSONResponse

    return JSONResponse(voices_list(request.app.state.server.voices.listing()))


async def models(request):
    from starlette.responses import JSONResponse

    settings = request.app.state.server.settings
    return JSONResponse(models_list((settings.lm.lm_model or "orpheus", *OPENAI_MODELS)))


async def openapi(request):
    """The OpenAPI 3.1 document of the HTTP routes (:func:`snac_fast.serve.routes.schema.openapi_document`)."""
    from starlette.responses import JSONResponse

    return JSONResponse(openapi_document())


def _with_docs(app) -> None:
    """``/docs``: Swagger UI (swagger-ui-py's page and assets) over ``/openapi.json``."""
    from starlette.routing import Route
    from swagger_ui import api_doc

    api_doc(app, config_rel_url="/openapi.json", url_prefix=DOCS_PREFIX, title="snac-fast serve")
    app.router.routes.append(Route(DOCS_PREFIX + "/openapi.json", openapi))  # the page asks its own prefix


async def metrics(request):
    from prometheus_client import CONTENT_TYPE_LATEST
    from starlette.responses import Response

    server: SpeechServer = request.app.state.server
    server.metrics.backend_values = await server.backend.metric_values()
    if server.settings.engine.gpu_memory_gb:
        server.metrics.backend_values["gpu_budget_bytes"] = server.settings.engine.gpu_memory_gb * 1e9
    return Response(server.metrics.text(), media_type=CONTENT_TYPE_LATEST)


def create_app(codec=None, settings: ServeSettings | None = None, engine: tuple[str, dict] | None = None):
    """The Starlette app serving ``codec`` (a :class:`~snac_fast.FastSNAC`) with ``settings``; or,
    with ``engine`` (an :class:`~snac_fast.serve.EngineProcess`'s ``address`` and ``info``) and no
    codec, feeding that engine process, which other workers share."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.routing import Route, WebSocketRoute

    settings = (settings or ServeSettings()).check()
    if (codec is None) == (engine is None):
        raise ValueError("create_app takes a codec or an engine process's (address, info), one of them")
    backend = (InProcessBackend(codec, settings.engine, settings.layout) if engine is None
               else EngineProcessBackend(*engine, settings.layout))
    server = SpeechServer(backend, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await server.warm_up()
        freeze_startup_objects()
        trim_periodically(settings.engine.memory_trim_s)
        yield
        await server.close()

    middleware = [Middleware(BodyLimit, max_bytes=settings.http.max_body_bytes, timeout_s=settings.http.header_timeout_s)]
    if settings.http.api_key:
        middleware.insert(0, Middleware(BearerKey, key=settings.http.api_key))  # outermost: the key first
    origins = frozenset(o.strip() for o in settings.http.allow_origins.split(",") if o.strip())
    if origins:  # browsers' preflights answered before the key is asked (they carry none)
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=sorted(origins), allow_methods=["*"],
                                        allow_headers=["*"], expose_headers=["X-Sample-Rate", "X-Sample-Format",
                                                                             "Server-Timing"]))
    middleware.insert(0, Middleware(OriginCheck, allowed=origins))  # outermost: another site's page refused first
    app = Starlette(routes=[Route("/", page), Route("/v1/audio/speech", speech, methods=["POST"]),
                            *[Route(f"/v1/text-to-speech/{{voice_id}}{form}", text_to_speech, methods=["POST"])
                              for form in ("", "/stream", "/with-timestamps", "/stream/with-timestamps")],
                            WebSocketRoute("/v1/audio/stream", stream_ids),
                            WebSocketRoute("/v1/text-to-speech/{voice_id}/stream-input", stream_input),
                            WebSocketRoute("/v1/text-to-speech/{voice_id}/multi-stream-input", multi_stream_input),
                            Route("/v1/audio/voices", voices), Route("/v1/models", models),
                            Route("/health", health), Route("/ready", ready), Route("/metrics", metrics),
                            Route("/openapi.json", openapi)],
                    middleware=middleware, lifespan=lifespan)
    _with_docs(app)
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
