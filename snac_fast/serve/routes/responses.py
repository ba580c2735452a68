"""A spoken request's HTTP response, as OpenAI's and ElevenLabs' speech routes both send it: the
status decided by the first audio (an LM that fails before it gets a clear error response; one that
fails after it ends the body, or an SSE stream with an ``error`` event), the audio encoded in the
asked format (:mod:`snac_fast.serve.services.formats`) and sent as soon as it is final, a client
that leaves freeing its stream at once.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from snac_fast.serve.access.limits import TooManyStreams, client_of
from snac_fast.serve.engine.client import EngineLostError
from snac_fast.serve.lm.client import LMBusyError, LMOutputError
from snac_fast.serve.routes.protocol import SpeechRequest, json_or_none
from snac_fast.serve.services.formats import AudioFormat, StreamEncoder, encoded
from snac_fast.serve.services.speech import FirstAudioTimes, speech_chunks

log = logging.getLogger("snac_fast.serve")

# a failed speech request's outcome label in the metrics -> its error type (SSE, JSON)
ERROR_TYPES = {"engine_lost": "engine_unavailable", "lm_error": "lm_output_error", "engine_error": "engine_error"}
ERROR_STATUS = {"engine_lost": 503, "lm_error": 502, "engine_error": 500}
TIMESTAMPED = "timestamped"  # a stream_format of ElevenLabs' routes: their "with timestamps" JSON, timings null


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
    # the encoder before the stream: an encoder that cannot open then holds no slot
    encoder = StreamEncoder(fmt, server.backend.rate, speech_request.sample_rate, seekable=not speech_request.stream,
                            speed=speech_request.speed)
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
    chunks = encoded(encoder, speech_chunks(server, sid, speech_request.text, speech_request.voice,
                                            speech_request.model, times, on_first_ids=encoder.prepare))
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
