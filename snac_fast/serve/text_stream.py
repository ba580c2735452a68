"""``WS /v1/text-to-speech/{voice_id}/stream-input``: text in as a voice agent's LLM writes it, audio
out before the text ends, in ElevenLabs' stream-input message shapes (their API reference,
"WebSocket", and their Python SDK's ``convert_realtime``), so the clients that speak it (Pipecat,
LiveKit, bolna and others through their ElevenLabs services) can point their base URL here.

Honoured: the path's voice (one of ``--voices``); the query's ``output_format`` (``pcm_8000`` ...
``pcm_48000``, ``ulaw_8000``, ``alaw_8000``, ``mp3_<rate>_<kbps>``; default ``mp3_44100_128``, as
theirs) and ``inactivity_timeout`` (seconds without a message before the server closes, default 20,
at most 180); messages ``{"text": ...}`` (buffered until a sentence ends), ``"flush": true`` (speak
the buffer now) and ``{"text": ""}`` (the end: speak the rest, send ``{"isFinal": true}``, close
1000); the key as ``xi-api-key`` or ``Authorization: Bearer``. Accepted and unused: ``model_id``,
``voice_settings``, ``generation_config`` (an Orpheus LM speaks whole sentences, so text goes to it
a sentence at a time, not by ``chunk_length_schedule``), ``try_trigger_generation``,
``enable_logging``, ``auto_mode``, ``sync_alignment``. Replies: ``{"audio": <base64 of the format's
bytes>, "isFinal": null, "normalizedAlignment": null, "alignment": null}`` (no word timings);
an error is ``{"message", "error", "code"}`` before a close.

Every sentence is one LM request, and all of a connection's sentences go into its one stream
(:func:`snac_fast.serve.speech.speech_chunks`), so the audio runs on across sentences with no seam.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import re

from snac_fast.serve.engine_client import EngineLostError
from snac_fast.serve.formats import FORMATS, AudioFormat, StreamEncoder
from snac_fast.serve.limits import MessageRate, TooManyStreams, client_of
from snac_fast.serve.lm_client import LMOutputError
from snac_fast.serve.segments import ended_sentences, split_text
from snac_fast.serve.speech import speech_chunks

DEFAULT_OUTPUT_FORMAT = "mp3_44100_128"  # ElevenLabs' default
INACTIVITY_TIMEOUT_S = (20.0, 180.0)  # ElevenLabs' default and largest
_MP3 = re.compile(r"mp3_(\d+)_(\d+)")
MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)  # what LAME encodes


def elevenlabs_format(name: str) -> AudioFormat | None:
    """An ElevenLabs ``output_format`` name as this server's format, or None if not served."""
    if name in ("ulaw_8000", "alaw_8000") or name.startswith("pcm_") and name in FORMATS:
        return FORMATS[name]
    match = _MP3.fullmatch(name)
    if match and int(match[1]) in MP3_RATES and 8 <= int(match[2]) <= 320:
        return dataclasses.replace(FORMATS["mp3"], name=name, rate=int(match[1]), bit_rate=int(match[2]) * 1000)
    return None


async def stream_input(websocket) -> None:
    """The route."""
    from starlette.websockets import WebSocketDisconnect

    server = websocket.app.state.server
    voice = websocket.path_params["voice_id"]
    fmt = elevenlabs_format(websocket.query_params.get("output_format", DEFAULT_OUTPUT_FORMAT))
    timeout = _timeout(websocket.query_params.get("inactivity_timeout"))
    await websocket.accept()
    problem = None
    if voice not in server.settings.voice_names:
        problem = f"voice_id must be one of {list(server.settings.voice_names)}, got {voice!r}"
    elif fmt is None:
        problem = ("output_format must be pcm_8000 ... pcm_48000, ulaw_8000, alaw_8000 or mp3_<rate>_<kbps>, got "
                   f"{websocket.query_params.get('output_format')!r}")
    elif timeout is None:
        problem = f"inactivity_timeout must be 1-{INACTIVITY_TIMEOUT_S[1]:g} seconds"
    if problem:
        await _close_with_error(websocket, problem, "invalid_request", 1008)
        return
    try:
        sid = await server.open_stream(None, client_of(websocket.scope))
    except EngineLostError as e:
        await _close_with_error(websocket, str(e), "engine_unavailable", 1011)
        return
    except TooManyStreams as e:
        await _close_with_error(websocket, str(e), "too_many_streams", 1008)
        return
    if sid is None:
        await _close_with_error(websocket, "all stream slots are in use; retry shortly", "server_busy", 1013)
        return
    encoder = StreamEncoder(fmt, server.backend.rate, fmt.rate)
    texts: asyncio.Queue = asyncio.Queue()  # sentences to speak, in order; None: the text has ended
    timed_out = False

    async def sentences():
        while (text := await texts.get()) is not None:
            yield text

    async def speak() -> None:
        async for audio in speech_chunks(server, sid, sentences(), voice, None):
            data = encoder.encode(audio)
            if data:
                await websocket.send_json(_audio(data))
        rest = encoder.finish()
        if rest:
            await websocket.send_json(_audio(rest))
    speaker = asyncio.create_task(speak())

    async def receive() -> None:
        """Text in until its end; a client gone stops the speaking at once (its slot freed)."""
        nonlocal timed_out
        buffer = ""
        rate = MessageRate(server.settings.max_ws_messages_per_s)
        try:
            while True:
                try:
                    raw = await asyncio.wait_for(websocket.receive(), timeout)
                except asyncio.TimeoutError:
                    timed_out = True
                    return
                if raw["type"] == "websocket.disconnect":
                    speaker.cancel()
                    return
                if not rate.allow():
                    speaker.cancel()
                    await _close_with_error(websocket, "more messages than --max-ws-messages-per-s",
                                            "rate_limited", 1008)
                    return
                message = _message(raw.get("text"))
                if isinstance(message, str):
                    await websocket.send_json({"message": message, "error": "invalid_message", "code": 1008})
                    continue
                text = message.get("text")
                if text == "":  # the end: the rest of the text is spoken
                    done, buffer = buffer, ""
                else:
                    buffer += text or ""
                    done, buffer = (buffer, "") if message.get("flush") else ended_sentences(buffer)
                for segment in split_text(done, server.settings.segment_chars) if done.strip() else []:
                    texts.put_nowait(segment)
                if text == "":
                    return
        except (WebSocketDisconnect, OSError):
            speaker.cancel()
        finally:
            texts.put_nowait(None)
    receiver = asyncio.create_task(receive())
    try:
        await asyncio.wait([speaker])
        if speaker.cancelled():
            server.metrics.outcome("text_stream", "closed")
        elif isinstance(speaker.exception(), (LMOutputError, RuntimeError)):  # the LM failed, or the engine
            e = speaker.exception()
            kind = "engine_unavailable" if isinstance(e, EngineLostError) else \
                "lm_output_error" if isinstance(e, LMOutputError) else "engine_error"
            server.metrics.outcome("text_stream", kind)
            await _close_with_error(websocket, str(e), kind, 1011)
        elif speaker.exception() is not None:  # the client went away while audio was sent
            server.metrics.outcome("text_stream", "closed")
        elif timed_out:
            server.metrics.outcome("text_stream", "timed_out")
            await _close_with_error(websocket, f"no message for {timeout:g} s (inactivity_timeout)",
                                    "input_timeout_exceeded", 1008)
        else:
            await websocket.send_json({"isFinal": True})
            await websocket.close(code=1000)
            server.metrics.outcome("text_stream", "done")
    except (WebSocketDisconnect, RuntimeError, OSError):  # gone before the last words
        server.metrics.outcome("text_stream", "closed")
    finally:
        receiver.cancel()
        speaker.cancel()
        server.stream_ended(sid, release=True)  # a speaker cancelled before it began never released it


def _timeout(text: str | None) -> float | None:
    if text is None:
        return INACTIVITY_TIMEOUT_S[0]
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 1 <= value <= INACTIVITY_TIMEOUT_S[1] else None


def _message(raw: str | None) -> dict | str:
    """A text message, or what is wrong with it (a binary one among them)."""
    try:
        message = json.loads(raw) if raw is not None else None
    except ValueError:
        message = None
    if not isinstance(message, dict):
        return 'messages must be JSON objects: {"text": "..."} (and "flush": true), {"text": ""} to end'
    if "text" not in message and not message.get("flush"):
        return f"a message needs 'text' (or \"flush\": true); got keys {sorted(message)[:8]}"
    if "text" in message and not isinstance(message["text"], str):
        return "'text' must be a string"
    return message


def _audio(data: bytes) -> dict:
    return {"audio": base64.b64encode(data).decode(), "isFinal": None, "normalizedAlignment": None, "alignment": None}


async def _close_with_error(websocket, message: str, error: str | None, code: int | None) -> None:
    try:
        await websocket.send_json({"message": message, "error": error, "code": code})
        await websocket.close(code=code, reason=message[:120])
    except (RuntimeError, OSError):
        pass
