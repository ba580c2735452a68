"""``snac-fast serve``: the decode side of an Orpheus-style TTS server, on Starlette (ASGI) and uvicorn.

- ``POST /v1/audio/speech`` (OpenAI's speech API: ``input``, ``voice``, ``response_format`` pcm or
  wav, plus ``sample_format`` s16/f32, ``seed``, ``stream_format`` audio/sse): the Orpheus prompt goes
  to an OpenAI-compatible completions server (``--lm-url``) with streaming on; the ``<custom_token_N>``
  tokens coming back are pushed through one shared :class:`~snac_fast.serving.AsyncStreamBatcher`
  and each piece of PCM is sent as soon as it is final.
- ``WS /v1/audio/stream``: ids in (JSON ``{"ids": [...]}`` or binary int32 little-endian), PCM out
  (binary), ``{"end": true}`` (or closing) ends the stream.
- ``GET /health``, ``GET /metrics`` (Prometheus text).

Every connection shares one engine (with ``--workers N --shared-engine``, one engine process fed by
every worker): a full engine answers 503 with Retry-After; a client that goes away releases its
stream at once. A shared engine process that dies fails every request at once (503) and stops the
server (exit status 1), for its supervisor to restart. Design notes: docs/server.md.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import signal
import struct
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from snac_fast.engine_process import EngineLostError
from snac_fast.lm_client import LMBusyError, LMClient, LMOutputError
from snac_fast.orpheus import ORPHEUS, TokenLayout
from snac_fast.serving import AsyncStreamBatcher, freeze_startup_objects

log = logging.getLogger("snac_fast.server")

RESPONSE_FORMATS = ("pcm", "wav")
SWITCH_INTERVAL_S = 0.0005
SAMPLE_FORMATS = {"s16": "int16", "f32": "float32"}
# engine calls failed in a row, none run between, that make /health answer 503 "engine_failing": a
# device that fails every call (a sticky CUDA error) gets its server restarted; a lone out-of-memory
# step does not
FAILING_CALLS = 8


@dataclass
class ServeConfig:
    """What ``snac-fast serve`` takes; see :func:`create_app`."""

    lm_url: str | None = None  # an OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1
    lm_model: str | None = None  # the completions request's model (default: the speech request's)
    max_streams: int = 256
    max_batch: int = 256
    idle_timeout_s: float = 60.0
    voice: str = "tara"
    max_tokens: int = 4096
    temperature: float = 0.6
    top_p: float = 0.8
    repetition_penalty: float = 1.3
    layout: TokenLayout = field(default_factory=lambda: ORPHEUS)
    lm_timeout_s: float = 60.0
    lookahead: int | str | None = None  # the streams' (StreamEngine): None exact, samples or "fp16"
    engine_thread: bool = False  # the batcher's engine calls on a thread of their own, not the event loop
    max_wait_ms: float = 0.0  # an engine call waits up to this long after its first push for max_batch pushes


class _Metrics:
    """Prometheus text for /metrics: the batcher's counters read at scrape time, plus the server's own."""

    def __init__(self, server: SpeechServer) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.registry = CollectorRegistry()
        frame_s = server.frame_seconds
        buckets = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, frame_s, 0.25, 1.0)
        self.push = Histogram("snac_fast_push_seconds", "push to audio, per push that returned audio",
                              buckets=buckets, registry=self.registry)
        self.first_audio = Histogram("snac_fast_first_audio_seconds", "time to first audio added by the server: "
                                     "from the LM chunk completing the first decodable frames to the first audio out",
                                     buckets=buckets, registry=self.registry)
        self.late = Counter("snac_fast_late_chunks", "pushes whose audio took longer than one frame of audio",
                            registry=self.registry)
        self.requests = Counter("snac_fast_requests", "requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=self.registry)
        batcher = server.batcher

        class _Batcher:
            def collect(self):
                if isinstance(batcher, _SharedEngineBatcher):  # the engine process's, read before the scrape
                    stats = batcher.stats
                    yield GaugeMetricFamily("snac_fast_engine_up", "whether the engine process answers",
                                            value=float(batcher.lost is None))
                    yield GaugeMetricFamily("snac_fast_active_streams", "open streams (of every worker)",
                                            value=stats["open_streams"])
                    yield GaugeMetricFamily("snac_fast_max_streams", "stream slots", value=server.max_streams)
                    yield CounterMetricFamily("snac_fast_steps", "engine calls", value=stats["batches"])
                    yield CounterMetricFamily("snac_fast_step_requests", "pushes run by engine calls", value=stats["requests"])
                    yield CounterMetricFamily("snac_fast_step_seconds", "host seconds in engine calls",
                                              value=stats["step_seconds"])
                    yield CounterMetricFamily("snac_fast_failed_steps", "engine calls that failed", value=stats["failed_calls"])
                    yield GaugeMetricFamily("snac_fast_failed_steps_in_a_row", "engine calls failed since the last that ran",
                                            value=stats["failed_in_a_row"])
                    return
                yield GaugeMetricFamily("snac_fast_active_streams", "open streams", value=batcher.open_streams)
                yield GaugeMetricFamily("snac_fast_max_streams", "stream slots", value=server.max_streams)
                yield GaugeMetricFamily("snac_fast_queue_depth", "pushes waiting for an engine call",
                                        value=batcher.queued)
                yield CounterMetricFamily("snac_fast_steps", "engine calls", value=batcher.batches)
                yield CounterMetricFamily("snac_fast_step_requests", "pushes run by engine calls", value=batcher.requests)
                yield CounterMetricFamily("snac_fast_step_seconds", "host seconds in engine calls",
                                          value=batcher.step_seconds)
                yield CounterMetricFamily("snac_fast_failed_steps", "engine calls that failed", value=batcher.failed_calls)
                yield GaugeMetricFamily("snac_fast_failed_steps_in_a_row", "engine calls failed since the last that ran",
                                        value=batcher.failed_in_a_row)
                yield CounterMetricFamily("snac_fast_idle_released", "streams released after idling",
                                          value=batcher.idle_released)

        self.registry.register(_Batcher())

    def observe_push(self, seconds: float, frame_seconds: float) -> None:
        self.push.observe(seconds)
        if seconds > frame_seconds:
            self.late.inc()


class _SharedEngineBatcher:
    """What :class:`SpeechServer` asks of its batcher, over an :class:`~snac_fast.engine_process.EngineClient`
    to one engine process that every worker feeds (``snac-fast serve --shared-engine``). The
    engine's counters come from its stats, read by :meth:`refresh` (before each /metrics scrape)."""

    def __init__(self, address: str, layout: TokenLayout) -> None:
        self.address, self.layout = address, layout
        self._client = None
        self.stats = {"open_streams": 0, "batches": 0, "requests": 0, "failed_calls": 0, "failed_in_a_row": 0,
                      "last_failure": None, "step_seconds": 0.0}

    def client(self):
        """The client, made in the event loop that uses it (its replies are resolved there)."""
        if self._client is None:
            from snac_fast.engine_process import EngineClient

            try:
                self._client = EngineClient(self.address, self.layout)
            except OSError as e:  # its socket refuses: the process is gone
                raise EngineLostError(f"cannot reach the engine process at {self.address}: {e}") from None
        return self._client

    @property
    def lost(self) -> EngineLostError | None:
        """Why the engine process cannot be reached, once it cannot."""
        return None if self._client is None else self._client.lost

    async def open(self, seed: int | None) -> int:
        return await self.client().open(seed)

    async def push_ids(self, stream_id: int, ids) -> np.ndarray:
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
        """This worker's open streams."""
        return 0 if self._client is None else self._client.open_streams

    async def refresh(self) -> None:
        self.stats.update(await self.client().stats())

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


class SpeechServer:
    """The state of one serving process: a codec's shared engine behind one batcher, an HTTP client
    for the LM, metrics. :func:`create_app` wraps it in a Starlette app."""

    def __init__(self, codec, config: ServeConfig, engine: tuple[str, dict] | None = None) -> None:
        self.codec, self.config = codec, config
        if engine is not None:  # a shared engine process: its address and what it told of itself
            address, info = engine
            config.layout.check_model(info["config"])
            self.engine, self.device, self.max_streams = None, info["device"], info["max_streams"]
            self.rate, samples_per_frame = int(info["config"]["sampling_rate"]), info["samples_per_frame"]
            self.batcher = _SharedEngineBatcher(address, config.layout)
        else:
            config.layout.check_model(codec.config)
            # The batcher runs its engine calls on this event loop (no engine thread). Any other
            # thread that takes the GIL (an executor's, a library's) would hold the loop for up to
            # the default 5 ms switch interval (with an engine thread: engine calls of hundreds of
            # ms at 256 HTTP streams). This process is ours (a server): it may set the interval.
            sys.setswitchinterval(SWITCH_INTERVAL_S)
            self.engine = codec.shared_stream_engine(config.lookahead, max_streams=config.max_streams)
            self.device, self.max_streams = str(codec.device), self.engine.max_streams
            self.rate, samples_per_frame = int(codec.config["sampling_rate"]), self.engine.samples_per_frame
            self.batcher = AsyncStreamBatcher(self.engine, max_batch=config.max_batch, max_wait_ms=config.max_wait_ms,
                                              layout=config.layout,
                                              output="float32", idle_timeout_s=config.idle_timeout_s,
                                              engine_thread=config.engine_thread)
        self.frame_seconds = samples_per_frame / self.rate
        self.metrics = _Metrics(self)
        self.draining = False
        self.lm = LMClient(config)

    # -- streams -------------------------------------------------------------------------------

    async def open_stream(self, seed: int | None) -> int | None:
        """A stream id, or None when the engine is full or the server is shutting down."""
        if self.draining or (self.engine is not None and self.engine.open_streams >= self.engine.max_streams):
            return None
        try:
            if self.engine is None:
                return await self.batcher.open(seed)
            return self.batcher.open(seed)
        except EngineLostError:
            raise
        except RuntimeError:  # all slots taken (between the look and the open)
            return None

    def engine_failures(self) -> tuple[int, str | None]:
        """Engine calls failed in a row (none ran since) and the last failure, as last read."""
        if self.engine is None:
            return self.batcher.stats["failed_in_a_row"], self.batcher.stats["last_failure"]
        return self.batcher.failed_in_a_row, self.batcher.last_failure

    @property
    def slots_in_use(self) -> int:
        return self.engine.open_streams if self.engine is not None else self.batcher.stats["open_streams"]

    async def push(self, sid: int, ids) -> np.ndarray:
        start = time.perf_counter()
        audio = await self.batcher.push_ids(sid, ids)
        if audio.size:
            self.metrics.observe_push(time.perf_counter() - start, self.frame_seconds)
        return audio

    async def warm_up(self, frames: int = 8) -> None:
        """Before the first request, each part of the request path once: the LM client's
        (:meth:`LMClient.warm_up`), a streaming response, and one silent stream through this
        worker's decode path (open, pushes of one frame of ids, flush). Otherwise the first
        requests paid for that first-time work: 256 clients right after start-up saw first audio
        p99 27-30 ms on an H100, 6-7 ms on the next load (docs/server.md)."""
        await self.lm.warm_up()
        from starlette.responses import StreamingResponse

        # a streaming response sent nowhere: anyio's task group and streams first used here, not at a
        # client's first audio
        await _send_nowhere(StreamingResponse(_one(_pcm_bytes(np.zeros(16, np.float32), "s16")), media_type="audio/pcm"))
        layout = self.config.layout
        frame = layout.offset + np.arange(layout.frame_size, dtype=np.int64) * layout.codebook_size  # code 0 each
        sid = await self.open_stream(seed=0)
        if sid is None:
            return
        try:
            for _ in range(frames):
                await self.batcher.push_ids(sid, frame)
            await self.batcher.flush(sid)
        except BaseException:
            self.batcher.release(sid)
            raise

    async def close(self) -> None:
        """Graceful shutdown: no new streams, then wait (up to 30 s) for the open ones to end."""
        self.draining = True
        deadline = time.monotonic() + 30.0
        while self.batcher.open_streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.batcher.close()  # the in-process batcher runs what is queued on this loop
        await self.lm.aclose()


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


def _wav_header(rate: int, sample_format: str) -> bytes:
    """A streaming WAV header: the sizes are unknown, written as 0xFFFFFFFF (as streaming servers do)."""
    bits, code = (16, 1) if sample_format == "s16" else (32, 3)  # PCM / IEEE float
    block = bits // 8
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE" + b"fmt " + struct.pack("<IHHIIHH", 16, code, 1, rate,
            rate * block, block, bits) + b"data" + struct.pack("<I", 0xFFFFFFFF))


def _pcm_bytes(audio: np.ndarray, sample_format: str) -> bytes:
    """float32 audio -> little-endian PCM bytes (s16: rounded and clipped like the batcher's int16)."""
    if sample_format == "s16":
        return np.clip(np.rint(audio * 32767.0), -32768, 32767).astype("<i2").tobytes()
    return audio.astype("<f4", copy=False).tobytes()


def create_app(codec, config: ServeConfig | None = None, engine: tuple[str, dict] | None = None):
    """The Starlette app serving ``codec`` (a :class:`~snac_fast.FastSNAC`) with ``config``; or,
    with ``engine`` (an :class:`~snac_fast.engine_process.EngineProcess`'s ``address`` and ``info``)
    and no codec, feeding that engine process, which other workers share."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route, WebSocketRoute
    from starlette.websockets import WebSocket, WebSocketDisconnect

    server = SpeechServer(codec, config or ServeConfig(), engine)

    def error(status: int, message: str, kind: str = "invalid_request_error", **headers) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status, headers=headers)

    async def speech(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the body must be JSON")
        text, voice = body.get("input"), body.get("voice", server.config.voice)
        response_format = body.get("response_format", "pcm")
        sample_format = body.get("sample_format", "s16")
        stream_format = body.get("stream_format", "audio")
        seed = body.get("seed")
        problems = [m for ok, m in [
            (isinstance(text, str) and text.strip(), "'input' must be a non-empty string"),
            (isinstance(voice, str) and voice, "'voice' must be a string"),
            (response_format in RESPONSE_FORMATS, f"'response_format' must be one of {list(RESPONSE_FORMATS)}"),
            (sample_format in SAMPLE_FORMATS, f"'sample_format' must be one of {list(SAMPLE_FORMATS)}"),
            (stream_format in ("audio", "sse"), "'stream_format' must be 'audio' or 'sse'"),
            (seed is None or (isinstance(seed, int) and not isinstance(seed, bool)), "'seed' must be an integer"),
        ] if not ok]
        if problems:
            server.metrics.requests.labels("speech", "bad_request").inc()
            return error(400, problems[0])
        try:
            sid = await server.open_stream(seed)
        except EngineLostError as e:
            server.metrics.requests.labels("speech", "engine_lost").inc()
            return error(503, str(e), "engine_unavailable")
        if sid is None:
            server.metrics.requests.labels("speech", "busy").inc()
            return error(503, "all stream slots are in use; retry shortly", "server_busy", **{"Retry-After": "1"})
        chunks = _speech_chunks(server, sid, text, voice, body.get("model"), sample_format)
        try:  # the status is decided by the first audio: an LM that fails before it gets a clear 502
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except LMBusyError as e:  # the LM is overloaded: the client may retry, as after a full engine
            log.warning("speech request failed before its first audio: %s", e)
            server.metrics.requests.labels("speech", "lm_busy").inc()
            return error(503, str(e), "lm_busy", **{"Retry-After": e.retry_after or "1"})
        except LMOutputError as e:
            log.warning("speech request failed before its first audio: %s", e)
            server.metrics.requests.labels("speech", "lm_error").inc()
            return error(502, str(e), "lm_output_error")
        except EngineLostError as e:
            server.metrics.requests.labels("speech", "engine_lost").inc()
            return error(503, str(e), "engine_unavailable")
        except RuntimeError as e:  # the engine call failed (out of memory, a device error): this request only
            log.error("speech request failed in the engine: %s", e)
            server.metrics.requests.labels("speech", "engine_error").inc()
            return error(500, f"the engine call failed: {e}", "engine_error")
        media = "audio/wav" if response_format == "wav" else "audio/pcm"
        head = _wav_header(server.rate, sample_format) if response_format == "wav" else b""
        headers = {"X-Sample-Rate": str(server.rate), "X-Sample-Format": sample_format}
        if stream_format == "sse":
            return StreamingResponse(_sse(server, head + first, chunks), media_type="text/event-stream", headers=headers)
        return StreamingResponse(_audio(server, head + first, chunks), media_type=media, headers=headers)

    async def stream_ids(websocket: WebSocket) -> None:
        await websocket.accept()
        seed = websocket.query_params.get("seed")
        try:
            sid = await server.open_stream(int(seed) if seed and seed.lstrip("-").isdigit() else None)
        except EngineLostError as e:
            await websocket.close(code=1011, reason=str(e)[:120])  # a close reason holds 123 bytes
            return
        if sid is None:
            await websocket.close(code=1013, reason="all stream slots are in use; retry shortly")
            return
        sample_format = websocket.query_params.get("sample_format", "s16")
        if sample_format not in SAMPLE_FORMATS:
            server.batcher.release(sid)
            await websocket.close(code=1003, reason=f"sample_format must be one of {list(SAMPLE_FORMATS)}")
            return
        ended = False
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    break
                if message.get("bytes") is not None:
                    data = message["bytes"]
                    if len(data) % 4:
                        await websocket.send_json({"type": "error", "message": "binary ids must be int32 little-endian"})
                        continue
                    ids, end = np.frombuffer(data, "<i4"), False
                else:
                    try:
                        request = json.loads(message.get("text") or "")
                        ids, end = request.get("ids", []), bool(request.get("end", False))
                    except (ValueError, AttributeError):
                        await websocket.send_json({"type": "error", "message": 'text messages must be JSON: {"ids": [...]} or {"end": true}'})
                        continue
                try:
                    if len(ids):
                        audio = await server.push(sid, ids)
                        if audio.size:
                            await websocket.send_bytes(_pcm_bytes(audio, sample_format))
                    if end:
                        ended = True
                        audio = await server.batcher.flush(sid, drop_incomplete_frame=True)
                        if audio.size:
                            await websocket.send_bytes(_pcm_bytes(audio, sample_format))
                        await websocket.send_json({"type": "done"})
                        await websocket.close()
                        break
                except ValueError as e:  # a bad id: this push fails, the stream goes on (if still open)
                    await websocket.send_json({"type": "error", "message": str(e)})
                    if not server.batcher.is_open(sid):
                        await websocket.close(code=1011, reason="the stream has ended")
                        break
                except RuntimeError as e:  # the engine process went away, or an engine call failed
                    await websocket.send_json({"type": "error", "message": str(e)})
                    await websocket.close(code=1011, reason="the engine process went away" if isinstance(e, EngineLostError)
                                          else "the engine call failed")
                    break
        except (WebSocketDisconnect, OSError):
            pass
        finally:
            if not ended:
                server.batcher.release(sid)
            server.metrics.requests.labels("stream", "done" if ended else "closed").inc()

    async def health(request: Request) -> JSONResponse:
        status = "draining" if server.draining else "ok"
        if server.engine is None:
            try:
                await server.batcher.refresh()
            except EngineLostError:
                status = "engine_lost"
        in_a_row, failure = server.engine_failures()
        if status == "ok" and in_a_row >= FAILING_CALLS:
            status = "engine_failing"
        body = {"status": status, "device": server.device, "open_streams": server.batcher.open_streams,
                "slots_in_use": server.slots_in_use, "max_streams": server.max_streams, "sampling_rate": server.rate}
        if status == "engine_failing":
            body["error"] = failure
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if server.engine is None:
            with contextlib.suppress(EngineLostError):  # the last counters read, and snac_fast_engine_up 0
                await server.batcher.refresh()
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

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


async def _speech_chunks(server: SpeechServer, sid: int, text: str, voice: str, model: str | None,
                         sample_format: str) -> AsyncIterator[bytes]:
    """PCM bytes of one speech request as they become final; the stream is released on any exit."""
    finished = False
    frame_size = server.config.layout.frame_size

    async def push(ids: list[int]) -> np.ndarray:
        try:
            return await server.push(sid, ids)
        except ValueError as e:
            if not server.batcher.is_open(sid):  # released meanwhile: idle past idle_timeout_s, say
                raise LMOutputError(f"the stream ended while the language model was still sending: {e}") from None
            raise LMOutputError(f"the language model sent a token that is not audio: {e}") from None

    try:
        first = True
        held: list[int] = []  # ids that complete no frame yet: pushing them would decode nothing
        position = 0  # ids pushed so far
        async for ids in server.lm.ids(text, voice, model):
            held += ids
            if position % frame_size + len(held) < frame_size:
                continue
            started = time.perf_counter()
            audio = await push(held)
            position, held = position + len(held), []
            if audio.size:
                if first:
                    server.metrics.first_audio.observe(time.perf_counter() - started)
                    first = False
                yield _pcm_bytes(audio, sample_format)
        if held:  # an incomplete last frame: its ids are checked, then dropped by the flush
            await push(held)
        finished = True
        audio = await server.batcher.flush(sid, drop_incomplete_frame=True)
        if audio.size:
            yield _pcm_bytes(audio, sample_format)
        server.metrics.requests.labels("speech", "done").inc()
    finally:
        if not finished:  # an error, or the client went away: free the slot now
            server.batcher.release(sid)


async def _audio(server: SpeechServer, first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if first:
        yield first
    try:
        async for chunk in chunks:
            yield chunk
    except (LMOutputError, RuntimeError) as e:  # after the headers: the body ends short (the error is in the log and metrics)
        log.warning("speech stream cut: %s", e)
        server.metrics.requests.labels("speech", _outcome(e)).inc()
        raise


def _outcome(error: Exception) -> str:
    """A failed speech request's outcome label in the metrics (and its SSE error type: _ERROR_TYPES)."""
    if isinstance(error, EngineLostError):
        return "engine_lost"
    return "lm_error" if isinstance(error, LMOutputError) else "engine_error"


_ERROR_TYPES = {"engine_lost": "engine_unavailable", "lm_error": "lm_output_error", "engine_error": "engine_error"}


async def _sse(server: SpeechServer, first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """OpenAI's speech stream_format="sse": speech.audio.delta events (base64 audio), then
    speech.audio.done, or an error event."""
    def event(payload: dict) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()

    if first:
        yield event({"type": "speech.audio.delta", "audio": base64.b64encode(first).decode()})
    try:
        async for chunk in chunks:
            yield event({"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode()})
    except (LMOutputError, RuntimeError) as e:
        outcome = _outcome(e)
        server.metrics.requests.labels("speech", outcome).inc()
        yield event({"type": "error", "error": {"message": str(e), "type": _ERROR_TYPES[outcome]}})
        return
    yield event({"type": "speech.audio.done"})


ENVIRONMENT = "SNAC_FAST_SERVE"  # the JSON settings each uvicorn worker process builds its app from
CLAIMS = "SNAC_FAST_SERVE_CLAIMS"  # a folder where each worker claims its number (its GPU among several)
MODEL_SETTINGS = ("model", "device", "dtype", "local_files_only")  # the settings that are not ServeConfig's


def worker_device(device: str | None, claims: str | None) -> str | None:
    """The device a worker process serves on: ``device`` when one was given; else, on a host of
    several CUDA GPUs, the worker's turn among them: each worker claims the next free number in
    ``claims`` (a folder the parent made; a file created exclusively per number), and worker k takes
    GPU k modulo their count, so that N workers spread over the GPUs. Else None (the default)."""
    import os

    import torch

    if device is not None or claims is None or not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return device
    number = 0
    while True:
        try:
            os.close(os.open(os.path.join(claims, str(number)), os.O_CREAT | os.O_EXCL))
            return f"cuda:{number % torch.cuda.device_count()}"
        except FileExistsError:
            number += 1


def app_from_environment():
    """uvicorn's app factory (``snac_fast.server:app_from_environment``, ``factory=True``): each
    worker process loads the model, warms it up and serves its share of the connections with its
    own engine (docs/serving.md: one engine per worker process)."""
    import os

    from snac_fast.api import FastSNAC

    settings = json.loads(os.environ[ENVIRONMENT])
    engine = settings.pop("engine", None)
    if engine is not None:  # --shared-engine: the parent runs the engine process; this worker feeds it
        for key in MODEL_SETTINGS:
            settings.pop(key, None)
        return create_app(None, ServeConfig(**settings), (engine["address"], engine["info"]))
    device = worker_device(settings.pop("device", None), os.environ.get(CLAIMS))
    codec = FastSNAC.from_pretrained(settings.pop("model"), device=device,
                                     dtype=settings.pop("dtype", None),
                                     local_files_only=settings.pop("local_files_only", False))
    config = ServeConfig(**settings)
    if codec.device.type == "cuda":
        codec.shared_stream_engine(config.lookahead, max_streams=config.max_streams)
        codec.warmup(streams=min(config.max_batch, config.max_streams), lookahead=config.lookahead)
    return create_app(codec, config)


def serve(settings: dict, host: str = "127.0.0.1", port: int = 8880, workers: int = 1,
          shared_engine: bool = False, engine_event_loop: bool = False) -> None:
    """Run the server with uvicorn: ``settings`` are :class:`ServeConfig`'s fields plus ``model``,
    ``device``, ``dtype`` and ``local_files_only``. Without a ``device``, ``workers`` processes on a
    host of several GPUs take them in turn (:func:`worker_device`). ``shared_engine``: one engine
    process (on ``device``) that all ``workers`` feed, so every connection shares one batch
    (docs/serving.md, "One engine process, fed by front-ends"), run on one event loop instead of
    threads with ``engine_event_loop``."""
    import os
    import shutil
    import tempfile

    import uvicorn

    engine, lost, closing = None, [], threading.Event()
    if shared_engine:
        from snac_fast.engine_process import EngineProcess

        config = ServeConfig(**{k: v for k, v in settings.items() if k not in MODEL_SETTINGS})
        engine = EngineProcess(settings["model"], device=settings.get("device"), dtype=settings.get("dtype"),
                               max_streams=config.max_streams, max_batch=config.max_batch, lookahead=config.lookahead,
                               output="float32", idle_timeout_s=config.idle_timeout_s,
                               local_files_only=settings.get("local_files_only", False),
                               event_loop=engine_event_loop, max_wait_ms=config.max_wait_ms)
        settings = {**settings, "engine": {"address": engine.address, "info": engine.info}}

        def watch() -> None:  # an engine process that dies stops the server: its supervisor restarts it
            code = engine.wait()
            if not closing.is_set():
                lost.append(code)
                log.error("the engine process exited with code %s: stopping the server", code)
                os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful shutdown (the workers', with several)
        threading.Thread(target=watch, name="snac-fast-engine-watch", daemon=True).start()
    os.environ[ENVIRONMENT] = json.dumps(settings)
    os.environ[CLAIMS] = claims = tempfile.mkdtemp(prefix="snac-fast-serve-")
    # uvicorn raises the signal that stopped it again once it has shut down: ignored here, so that
    # the engine process and the folders are cleaned up and serve() returns
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.run("snac_fast.server:app_from_environment", factory=True, host=host, port=port, workers=workers,
                    timeout_graceful_shutdown=30, log_level="info")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        closing.set()
        shutil.rmtree(claims, ignore_errors=True)
        if engine is not None:
            engine.close()
    if lost:
        raise EngineLostError(f"the engine process exited with code {lost[0]}; the server stopped")
