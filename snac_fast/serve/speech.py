"""``POST /v1/audio/speech``: OpenAI's speech API over the LM and the backend.

The body is checked first (:class:`~snac_fast.serve.protocol.SpeechRequest`); the Orpheus prompt
goes to the LM; the audio token ids coming back are pushed into one stream as they complete
frames, and each piece of audio is encoded in the asked format (:mod:`snac_fast.serve.formats`) and
sent as soon as it is final. The status is decided by the first audio: an LM that fails before it
gets a clear error response; one that fails after it ends the body (an SSE stream with an
``error`` event).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from snac_fast.serve.engine_client import EngineLostError
from snac_fast.serve.formats import FLOAT_FORMATS, FORMATS, AudioFormat, StreamEncoder
from snac_fast.serve.limits import TooManyStreams, client_of
from snac_fast.serve.lm_client import LMBusyError, LMOutputError
from snac_fast.serve.protocol import RequestError, SpeechRequest, json_or_none
from snac_fast.serve.segments import split_text

log = logging.getLogger("snac_fast.serve")

# a failed speech request's outcome label in the metrics -> its error type (SSE, JSON)
ERROR_TYPES = {"engine_lost": "engine_unavailable", "lm_error": "lm_output_error", "engine_error": "engine_error"}
ERROR_STATUS = {"engine_lost": 503, "lm_error": 502, "engine_error": 500}
TIMESTAMPED = "timestamped"  # a stream_format of ElevenLabs' routes: their "with timestamps" JSON, timings null


def error_response(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                   **headers):
    """An error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return _error(RequestError(message, status=status, kind=kind, code=code), **headers)


def _error(error: RequestError, **headers):
    from starlette.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status, headers=headers)


@dataclass
class FirstAudioTimes:
    """When one speech request reached each step to its first audio (``time.perf_counter()``), sent
    to the client as a ``Server-Timing`` header (:meth:`header`) with the first audio."""

    received: float  # the route began (the body read)
    lm_asked: float | None = None  # the LM request went out
    lm_first_ids: float | None = None  # the LM's first audio ids arrived
    frames_ready: float | None = None  # the LM chunk completing the first decodable frames arrived
    audio: float | None = None  # the engine returned the first audio
    encoded: float | None = None  # the format's first bytes were ready

    def header(self) -> str:
        """``Server-Timing``: ``setup`` (to the LM request), ``lm_first`` (to the LM's first ids),
        ``lm`` (to the chunk completing the first decodable frames), ``engine``, ``encode``, ``total``;
        and two clock marks, ``lm_asked_at`` and ``frames_ready_at`` (ms on the host's monotonic
        clock, which ``time.perf_counter`` reads on Linux), with which a harness on the same host
        splits ``lm`` into the request's way to the LM and the answer's way back."""
        marks = [("setup", self.received, self.lm_asked), ("lm_first", self.lm_asked, self.lm_first_ids),
                 ("lm", self.lm_asked, self.frames_ready), ("engine", self.frames_ready, self.audio),
                 ("encode", self.audio, self.encoded), ("total", self.received, self.encoded),
                 ("lm_asked_at", 0.0, self.lm_asked), ("frames_ready_at", 0.0, self.frames_ready)]
        return ", ".join(f"{name};dur={(end - start) * 1e3:.2f}" for name, start, end in marks
                         if start is not None and end is not None)


async def speech(request):
    """The route."""
    times = FirstAudioTimes(time.perf_counter())
    server = request.app.state.server
    body = await json_body(request)
    try:
        if body is None:
            raise RequestError("the body must be JSON")
        speech_request = SpeechRequest.parse(body, server.settings.voice_names, server.settings.voice,
                                             server.settings.max_input_chars)
    except RequestError as e:
        server.metrics.outcome("speech", "bad_request")
        return _error(e)
    fmt = (FLOAT_FORMATS if speech_request.sample_format == "f32" else FORMATS)[speech_request.response_format]
    return await spoken_response(request, speech_request, fmt, times, error_response)


async def json_body(request):
    """A request's JSON body, or None when it is not JSON."""
    return json_or_none(await request.body())


async def spoken_response(request, speech_request: SpeechRequest, fmt: AudioFormat, times: FirstAudioTimes,
                          error: Callable[..., Any], endpoint: str = "speech"):
    """A checked request spoken in ``fmt``: its stream opened, the LM asked, the response (streamed,
    or whole with ``stream`` false) once the first audio is encoded. ``error(status, message,
    kind, code=None, **headers)``: a refusal in the endpoint's protocol (OpenAI's, ElevenLabs');
    ``endpoint``: its label in the metrics."""
    from starlette.responses import Response, StreamingResponse

    server = request.app.state.server
    try:
        sid = await server.open_stream(speech_request.seed, client_of(request.scope))
    except EngineLostError as e:
        server.metrics.outcome(endpoint, "engine_lost")
        return error(503, str(e), "engine_unavailable")
    except TooManyStreams as e:
        server.metrics.outcome(endpoint, "client_limit")
        return error(429, str(e), "rate_limit_exceeded", code="too_many_streams", **{"Retry-After": "1"})
    if sid is None:
        server.metrics.outcome(endpoint, "busy")
        return error(503, "all stream slots are in use; retry shortly", "server_busy", **{"Retry-After": "1"})
    encoder = StreamEncoder(fmt, server.backend.rate, speech_request.sample_rate, seekable=not speech_request.stream,
                            speed=speech_request.speed)
    chunks = _encoded(encoder, speech_chunks(server, sid, speech_request.text, speech_request.voice,
                                             speech_request.model, times))
    try:  # the status is decided by the first audio: an LM that fails before it gets a clear 502
        first = await _unless_gone(request, chunks.__anext__())
        times.encoded = time.perf_counter()
    except StopAsyncIteration:
        first = b""
    except ClientGone:
        await chunks.aclose()  # the stream's slot back now, not when its audio would have been made
        server.metrics.outcome(endpoint, "closed")
        return Response(status_code=499)
    except LMBusyError as e:  # the LM is overloaded: the client may retry, as after a full engine
        log.warning("speech request failed before its first audio: %s", e)
        server.metrics.outcome(endpoint, "lm_busy")
        return error(503, str(e), "lm_busy", **{"Retry-After": e.retry_after or "1"})
    except LMOutputError as e:
        log.warning("speech request failed before its first audio: %s", e)
        server.metrics.outcome(endpoint, "lm_error")
        return error(502, str(e), "lm_output_error")
    except EngineLostError as e:
        server.metrics.outcome(endpoint, "engine_lost")
        return error(503, str(e), "engine_unavailable")
    except RuntimeError as e:  # the engine call failed (out of memory, a device error): this request only
        log.error("speech request failed in the engine: %s", e)
        server.metrics.outcome(endpoint, "engine_error")
        return error(500, f"the engine call failed: {e}", "engine_error")
    headers = {"X-Sample-Rate": str(encoder.rate), "X-Sample-Format": speech_request.sample_format,
               "Server-Timing": times.header()}
    if not speech_request.stream:  # the whole file, its sizes true
        try:
            rest = b"".join(await _unless_gone(request, _collected(chunks)))
        except ClientGone:
            await chunks.aclose()
            server.metrics.outcome(endpoint, "closed")
            return Response(status_code=499)
        except (LMOutputError, RuntimeError) as e:
            outcome = _outcome(e)
            server.metrics.outcome(endpoint, outcome)
            return error(ERROR_STATUS[outcome], str(e), ERROR_TYPES[outcome])
        if speech_request.stream_format == TIMESTAMPED:
            return Response(_timestamped(first + rest), media_type="application/json", headers=headers)
        return Response(first + rest, media_type=fmt.media_type, headers=headers)
    if speech_request.stream_format == "sse":
        return StreamingResponse(_sse(server, first, chunks), media_type="text/event-stream", headers=headers)
    if speech_request.stream_format == TIMESTAMPED:
        return StreamingResponse(_timestamped_lines(server, first, chunks, endpoint), media_type="application/json",
                                 headers=headers)
    return StreamingResponse(_audio(server, first, chunks, endpoint), media_type=fmt.media_type, headers=headers)


class ClientGone(Exception):
    """The client disconnected while its response was being made."""


async def _unless_gone(request, awaitable):
    """``awaitable``'s result, or :class:`ClientGone` as soon as the client disconnects (its work
    cancelled): a client that left before its first audio, or before a whole file was made, held its
    stream's slot until the idle timeout or the audio's end (48.8 s for 2,500 characters)."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        gone.cancel()
    if not work.done():
        work.cancel()
        with contextlib.suppress(BaseException):
            await work
        raise ClientGone
    return work.result()


async def _disconnected(request) -> None:
    """Returns when the client disconnects (its body was read whole: the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collected(chunks: AsyncIterator[bytes]) -> list[bytes]:
    return [chunk async for chunk in chunks]


async def _encoded(encoder: StreamEncoder, audio: AsyncIterator[np.ndarray]) -> AsyncIterator[bytes]:
    """The stream's audio in its format: each piece's bytes as soon as the encoder has them, then
    the encoder's rest (its held frames, the container's trailer). Encoded on the event loop: a
    thread pool (FFmpeg releases the GIL) doubled the server's CPU at 256 mp3 streams and did not
    keep them in pace either (docs/server.md, "Formats")."""
    async for piece in audio:
        data = encoder.encode(piece)
        if data:
            yield data
    rest = encoder.finish()
    if rest:
        yield rest


async def segment_ids(lm, texts: AsyncIterable[str], voice: str, model: str | None
                      ) -> AsyncIterator[tuple[int, list[int]]]:
    """(segment index, audio ids) of the LM's answer to each text of ``texts``, in order, as texts
    keep arriving (a text WebSocket's sentences) or all known (a long input's segments). Segment
    k+1's request goes out once segment k's first ids have arrived (or k ended) and its text is
    known, so its first tokens are ready when k ends: two requests at most in flight, and the first
    one alone until it speaks. An LM error surfaces where its segment's ids would have."""
    known: list[str] = []
    queues: list[asyncio.Queue] = []
    tasks: list[asyncio.Task] = []
    at = {"segment": 0, "spoke": False}
    arrived = asyncio.Event()

    async def fill(text: str, queue: asyncio.Queue) -> None:
        try:
            async for ids in lm.ids(text, voice, model):
                queue.put_nowait(ids)
            queue.put_nowait(None)
        except Exception as e:  # noqa: BLE001 (handed to the reader, in order)
            queue.put_nowait(e)

    def start_allowed() -> None:
        last = at["segment"] + at["spoke"]  # segment k, and k+1 once k has spoken
        while len(tasks) <= last and len(tasks) < len(known):
            queues.append(asyncio.Queue())
            tasks.append(asyncio.create_task(fill(known[len(tasks)], queues[-1])))

    async def read() -> None:
        try:
            async for text in texts:
                known.append(text)
                start_allowed()
                arrived.set()
        finally:  # the task is done when its waiter next runs
            arrived.set()
    reader = asyncio.create_task(read())
    try:
        while True:
            k = at["segment"]
            while len(queues) <= k:  # segment k's text has not come yet
                if reader.done():
                    if reader.exception() is not None:
                        raise reader.exception()
                    return
                arrived.clear()
                await arrived.wait()
            while (item := await queues[k].get()) is not None:
                if isinstance(item, Exception):
                    raise item
                if not at["spoke"]:
                    at["spoke"] = True
                    start_allowed()
                yield k, item
            at["segment"], at["spoke"] = k + 1, False
            start_allowed()
    finally:
        for task in (reader, *tasks):
            task.cancel()


async def _listed(texts: list[str]) -> AsyncIterator[str]:
    for text in texts:
        yield text


async def speech_chunks(server, sid: int, text: str | AsyncIterable[str], voice: str, model: str | None,
                        times: FirstAudioTimes | None = None) -> AsyncIterator[np.ndarray]:
    """float32 audio of one stream's speech as it becomes final; the stream is released on any exit.
    ``text``: a text, spoken a segment at a time when longer than ``--segment-chars``
    (:mod:`snac_fast.serve.segments`), or texts as they arrive; all of them into this one stream.
    ``times``: marked on the way to the first audio."""
    times = times or FirstAudioTimes(time.perf_counter())
    finished = False
    frame_size = server.settings.layout.frame_size
    texts = _listed(split_text(text, server.settings.segment_chars)) if isinstance(text, str) else text

    async def push(ids: list[int]) -> np.ndarray:
        try:
            return await server.push(sid, ids)
        except ValueError as e:
            if not server.backend.is_open(sid):  # released meanwhile: idle past idle_timeout_s, say
                raise LMOutputError(f"the stream ended while the language model was still sending: {e}") from None
            raise LMOutputError(f"the language model sent a token that is not audio: {e}") from None

    async def whole_frames(ids: list[int]) -> AsyncIterator[np.ndarray]:
        """The audio of whole frames' ids: all that arrived in one push (a stream that fell behind
        catches up in one call); where one of them is not audio, the frames before it a push each,
        so that their audio goes out before the error (a push is checked whole before it runs)."""
        try:
            yield await push(ids)
            return
        except LMOutputError:
            if len(ids) <= frame_size or not server.backend.is_open(sid):
                raise
        for start in range(0, len(ids), frame_size):
            yield await push(ids[start:start + frame_size])

    try:
        first = True
        held: list[int] = []  # ids of a frame not yet whole: only whole frames are pushed
        segment = 0
        times.lm_asked = time.perf_counter()
        async for k, ids in segment_ids(server.lm, texts, voice, model):
            if times.lm_first_ids is None:
                times.lm_first_ids = time.perf_counter()
            if k != segment:  # a join: an LM that stopped mid-frame leaves a piece of a frame, dropped
                segment, held = k, []
            held += ids
            whole = len(held) - len(held) % frame_size
            if not whole:
                continue
            started = time.perf_counter()
            async with contextlib.aclosing(whole_frames(held[:whole])) as pieces:
                async for audio in pieces:
                    if audio.size:
                        if first:
                            times.frames_ready, times.audio = started, time.perf_counter()
                            server.metrics.first_audio.observe(times.audio - started)
                            first = False
                        yield audio
            held = held[whole:]
        if held:  # an incomplete last frame: its ids are checked, then dropped by the flush
            await push(held)
        finished = True
        audio = await server.backend.flush(sid, drop_incomplete_frame=True)
        if audio.size:
            yield audio
        server.metrics.outcome("speech", "done")
    finally:  # an error, or the client went away: free the slot now
        server.stream_ended(sid, release=not finished)


def _outcome(error: Exception) -> str:
    """A failed speech request's outcome label (a key of :data:`ERROR_TYPES`)."""
    if isinstance(error, EngineLostError):
        return "engine_lost"
    return "lm_error" if isinstance(error, LMOutputError) else "engine_error"


def _timestamped(audio: bytes) -> bytes:
    """ElevenLabs' "with timestamps" shape of a piece of audio, as a line: base64 audio and no
    character timings (this server has none)."""
    return json.dumps({"audio_base64": base64.b64encode(audio).decode(), "alignment": None,
                       "normalized_alignment": None}).encode() + b"\n"


async def _timestamped_lines(server, first: bytes, chunks: AsyncIterator[bytes], endpoint: str) -> AsyncIterator[bytes]:
    """ElevenLabs' streamed "with timestamps" body: a JSON line per piece of audio."""
    async for chunk in _audio(server, first, chunks, endpoint):
        yield _timestamped(chunk)


async def _audio(server, first: bytes, chunks: AsyncIterator[bytes], endpoint: str) -> AsyncIterator[bytes]:
    if first:
        yield first
    try:
        async for chunk in chunks:
            yield chunk
    except (LMOutputError, RuntimeError) as e:  # after the headers: the body ends short (the error is in the log and metrics)
        log.warning("speech stream cut: %s", e)
        server.metrics.outcome(endpoint, _outcome(e))
        raise


async def _sse(server, first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
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
        server.metrics.outcome("speech", outcome)
        yield event({"type": "error", "error": {"message": str(e), "type": ERROR_TYPES[outcome]}})
        return
    yield event({"type": "speech.audio.done"})
