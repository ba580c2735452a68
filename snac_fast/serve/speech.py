"""``POST /v1/audio/speech``: OpenAI's speech API over the LM and the backend.

The body (``input``, ``voice``, ``response_format`` pcm or wav, plus ``sample_format`` s16/f32,
``seed``, ``stream_format`` audio/sse) is checked first; the Orpheus prompt goes to the LM; the
audio token ids coming back are pushed into one stream as they complete frames, and each piece of
PCM is sent as soon as it is final. The status is decided by the first audio: an LM that fails
before it gets a clear error response; one that fails after it ends the body (an SSE stream with an
``error`` event).
"""

from __future__ import annotations

import base64
import json
import logging
import struct
import time
from collections.abc import AsyncIterator

import numpy as np

from snac_fast.serve.engine_client import EngineLostError
from snac_fast.serve.lm_client import LMBusyError, LMOutputError

log = logging.getLogger("snac_fast.serve")

RESPONSE_FORMATS = ("pcm", "wav")
SAMPLE_FORMATS = {"s16": "int16", "f32": "float32"}
STREAM_FORMATS = ("audio", "sse")
# a failed speech request's outcome label in the metrics -> its error type (SSE, JSON)
ERROR_TYPES = {"engine_lost": "engine_unavailable", "lm_error": "lm_output_error", "engine_error": "engine_error"}


def error_response(status: int, message: str, kind: str = "invalid_request_error", **headers):
    """An error in OpenAI's shape: ``{"error": {"message", "type"}}``."""
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status, headers=headers)


def body_problem(body: dict, default_voice: str) -> str | None:
    """The first thing wrong with a speech request's body, or None."""
    text, voice, seed = body.get("input"), body.get("voice", default_voice), body.get("seed")
    checks = [
        (isinstance(text, str) and text.strip(), "'input' must be a non-empty string"),
        (isinstance(voice, str) and voice, "'voice' must be a string"),
        (body.get("response_format", "pcm") in RESPONSE_FORMATS, f"'response_format' must be one of {list(RESPONSE_FORMATS)}"),
        (body.get("sample_format", "s16") in SAMPLE_FORMATS, f"'sample_format' must be one of {list(SAMPLE_FORMATS)}"),
        (body.get("stream_format", "audio") in STREAM_FORMATS, "'stream_format' must be 'audio' or 'sse'"),
        (seed is None or (isinstance(seed, int) and not isinstance(seed, bool)), "'seed' must be an integer"),
    ]
    return next((message for ok, message in checks if not ok), None)


async def speech(request):
    """The route."""
    from starlette.responses import StreamingResponse

    server = request.app.state.server
    try:
        body = await request.json()
    except ValueError:
        return error_response(400, "the body must be JSON")
    if not isinstance(body, dict) or (problem := body_problem(body, server.settings.voice)):
        server.metrics.outcome("speech", "bad_request")
        return error_response(400, problem if isinstance(body, dict) else "the body must be a JSON object")
    voice = body.get("voice", server.settings.voice)
    response_format, sample_format = body.get("response_format", "pcm"), body.get("sample_format", "s16")
    try:
        sid = await server.open_stream(body.get("seed"))
    except EngineLostError as e:
        server.metrics.outcome("speech", "engine_lost")
        return error_response(503, str(e), "engine_unavailable")
    if sid is None:
        server.metrics.outcome("speech", "busy")
        return error_response(503, "all stream slots are in use; retry shortly", "server_busy", **{"Retry-After": "1"})
    chunks = speech_chunks(server, sid, body["input"], voice, body.get("model"), sample_format)
    try:  # the status is decided by the first audio: an LM that fails before it gets a clear 502
        first = await chunks.__anext__()
    except StopAsyncIteration:
        first = b""
    except LMBusyError as e:  # the LM is overloaded: the client may retry, as after a full engine
        log.warning("speech request failed before its first audio: %s", e)
        server.metrics.outcome("speech", "lm_busy")
        return error_response(503, str(e), "lm_busy", **{"Retry-After": e.retry_after or "1"})
    except LMOutputError as e:
        log.warning("speech request failed before its first audio: %s", e)
        server.metrics.outcome("speech", "lm_error")
        return error_response(502, str(e), "lm_output_error")
    except EngineLostError as e:
        server.metrics.outcome("speech", "engine_lost")
        return error_response(503, str(e), "engine_unavailable")
    except RuntimeError as e:  # the engine call failed (out of memory, a device error): this request only
        log.error("speech request failed in the engine: %s", e)
        server.metrics.outcome("speech", "engine_error")
        return error_response(500, f"the engine call failed: {e}", "engine_error")
    media = "audio/wav" if response_format == "wav" else "audio/pcm"
    head = wav_header(server.backend.rate, sample_format) if response_format == "wav" else b""
    headers = {"X-Sample-Rate": str(server.backend.rate), "X-Sample-Format": sample_format}
    if body.get("stream_format", "audio") == "sse":
        return StreamingResponse(_sse(server, head + first, chunks), media_type="text/event-stream", headers=headers)
    return StreamingResponse(_audio(server, head + first, chunks), media_type=media, headers=headers)


async def speech_chunks(server, sid: int, text: str, voice: str, model: str | None,
                        sample_format: str) -> AsyncIterator[bytes]:
    """PCM bytes of one speech request as they become final; the stream is released on any exit."""
    finished = False
    frame_size = server.settings.layout.frame_size

    async def push(ids: list[int]) -> np.ndarray:
        try:
            return await server.push(sid, ids)
        except ValueError as e:
            if not server.backend.is_open(sid):  # released meanwhile: idle past idle_timeout_s, say
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
                yield pcm_bytes(audio, sample_format)
        if held:  # an incomplete last frame: its ids are checked, then dropped by the flush
            await push(held)
        finished = True
        audio = await server.backend.flush(sid, drop_incomplete_frame=True)
        if audio.size:
            yield pcm_bytes(audio, sample_format)
        server.metrics.outcome("speech", "done")
    finally:
        if not finished:  # an error, or the client went away: free the slot now
            server.backend.release(sid)


def _outcome(error: Exception) -> str:
    """A failed speech request's outcome label (a key of :data:`ERROR_TYPES`)."""
    if isinstance(error, EngineLostError):
        return "engine_lost"
    return "lm_error" if isinstance(error, LMOutputError) else "engine_error"


async def _audio(server, first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if first:
        yield first
    try:
        async for chunk in chunks:
            yield chunk
    except (LMOutputError, RuntimeError) as e:  # after the headers: the body ends short (the error is in the log and metrics)
        log.warning("speech stream cut: %s", e)
        server.metrics.outcome("speech", _outcome(e))
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


def wav_header(rate: int, sample_format: str) -> bytes:
    """A streaming WAV header: the sizes are unknown, written as 0xFFFFFFFF (as streaming servers do)."""
    bits, code = (16, 1) if sample_format == "s16" else (32, 3)  # PCM / IEEE float
    block = bits // 8
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE" + b"fmt " + struct.pack("<IHHIIHH", 16, code, 1, rate,
            rate * block, block, bits) + b"data" + struct.pack("<I", 0xFFFFFFFF))


def pcm_bytes(audio: np.ndarray, sample_format: str) -> bytes:
    """float32 audio -> little-endian PCM bytes (s16: rounded and clipped like the batcher's int16)."""
    if sample_format == "s16":
        return np.clip(np.rint(audio * 32767.0), -32768, 32767).astype("<i2").tobytes()
    return audio.astype("<f4", copy=False).tobytes()
