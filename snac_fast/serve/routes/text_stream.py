"""``WS /v1/text-to-speech/{voice_id}/stream-input``: text in as a voice agent's LLM writes it, audio
out before the text ends, in ElevenLabs' stream-input message shapes (their API reference,
"WebSocket", and their Python SDK's ``convert_realtime``), so the clients that speak it (Pipecat,
LiveKit, bolna and others through their ElevenLabs services) can point their base URL here.

Honoured: the path's voice (a voice of the LM's preset, or of ``--voices``); the query's ``output_format`` (``pcm_8000`` ...
``pcm_48000``, ``ulaw_8000``, ``alaw_8000``, ``mp3_<rate>_<kbps>``; default ``mp3_44100_128``, as
theirs) and ``inactivity_timeout`` (seconds without a message before the server closes, default 20,
at most 180); messages ``{"text": ...}`` (buffered until a sentence ends), ``"flush": true`` (speak
the buffer now) and ``{"text": ""}`` (the end: speak the rest, send ``{"isFinal": true}``, close
1000); the opening message's ``voice_settings.speed`` (as OpenAI's ``speed``: FFmpeg's ``atempo``,
the pitch kept); the key as ``xi-api-key`` or ``Authorization: Bearer``. Accepted and unused:
``model_id``, the rest of ``voice_settings``, ``generation_config`` (an Orpheus LM speaks whole
sentences, so text goes to it a sentence at a time, not by ``chunk_length_schedule``),
``try_trigger_generation``, ``enable_logging``, ``auto_mode``, ``sync_alignment``. Replies:
``{"audio": <base64 of the format's bytes>, "isFinal": null, "normalizedAlignment": null,
"alignment": null}`` (no word timings); an error is ``{"message", "error", "code"}`` before a close.

Every sentence is one LM request, and all of a connection's sentences go into its one stream
(:class:`snac_fast.serve.services.spoken_text.SpokenText`), so the audio runs on across sentences with no
seam. The multi-context form, which Pipecat's and LiveKit's ElevenLabs services speak, is
:mod:`snac_fast.serve.routes.text_contexts`.
"""

from __future__ import annotations

import asyncio

from snac_fast.serve.access.limits import MessageRate, TooManyStreams, client_of
from snac_fast.serve.engine.client import EngineLostError
from snac_fast.serve.lm.client import LMOutputError
from snac_fast.serve.routes.elevenlabs_protocol import (
    audio_message,
    close_with_error,
    connection_problem,
    error_kind,
    error_message,
    json_object,
    voice_speed,
)
from snac_fast.serve.routes.protocol import checked_text
from snac_fast.serve.services.formats import StreamEncoder
from snac_fast.serve.services.spoken_text import SpokenText, TextBacklogError


async def stream_input(websocket) -> None:
    """The route."""
    from starlette.websockets import WebSocketDisconnect

    server = websocket.app.state.server
    problem, fmt, timeout = connection_problem(websocket)
    await websocket.accept()
    if problem:
        await close_with_error(websocket, problem, "invalid_request", 1008)
        return
    try:
        sid = await server.open_stream(None, client_of(websocket.scope))
    except EngineLostError as e:
        await close_with_error(websocket, str(e), "engine_unavailable", 1011)
        return
    except TooManyStreams as e:
        await close_with_error(websocket, str(e), "too_many_streams", 1008)
        return
    if sid is None:
        await close_with_error(websocket, "all stream slots are in use; retry shortly", "server_busy", 1013)
        return

    async def send(data: bytes) -> None:
        await websocket.send_json(audio_message(data))
    text = SpokenText(server, sid, websocket.path_params["voice_id"], StreamEncoder(fmt, server.backend.rate, fmt.rate),
                      send)
    speaker = text.task
    timed_out = False

    async def receive() -> None:
        """Text in until its end; a client gone stops the speaking at once (its slot freed)."""
        nonlocal timed_out
        rate = MessageRate(server.settings.http.max_ws_messages_per_s)
        try:
            while True:
                try:
                    raw = await asyncio.wait_for(websocket.receive(), timeout)
                except asyncio.TimeoutError:
                    timed_out = True
                    return
                if raw["type"] == "websocket.disconnect":
                    text.cancel()
                    return
                if not rate.allow():
                    text.cancel()
                    await close_with_error(websocket, "more messages than --max-ws-messages-per-s", "rate_limited", 1008)
                    return
                message = _message(raw.get("text"))
                if isinstance(message, str):
                    await websocket.send_json(error_message(message, "invalid_message", 1008))
                    continue
                if message.get("text") == "":  # the end: the rest of the text is spoken
                    text.end()
                    return
                if "voice_settings" in message and not text.has_text:  # the opening message's
                    try:
                        text.set_speed(voice_speed(message["voice_settings"]))
                    except ValueError as e:
                        await websocket.send_json(error_message(str(e), "invalid_message", 1008))
                try:
                    text.add(message.get("text") or "", flush=bool(message.get("flush")))
                except TextBacklogError as e:
                    text.cancel()
                    await close_with_error(websocket, str(e), "text_backlog_exceeded", 1008)
                    return
        except (WebSocketDisconnect, OSError):
            text.cancel()
        finally:
            text.end(speak_rest=False)  # a time-out: what was never flushed nor ended is not spoken
    receiver = asyncio.create_task(receive())
    try:
        await asyncio.wait([speaker])
        if speaker.cancelled():
            server.metrics.outcome("text_stream", "closed")
        elif isinstance(speaker.exception(), (LMOutputError, RuntimeError)):  # the LM failed, or the engine
            kind = error_kind(speaker.exception())
            server.metrics.outcome("text_stream", kind)
            await close_with_error(websocket, str(speaker.exception()), kind, 1011)
        elif speaker.exception() is not None:  # the client went away while audio was sent
            server.metrics.outcome("text_stream", "closed")
        elif timed_out:
            server.metrics.outcome("text_stream", "timed_out")
            await close_with_error(websocket, f"no message for {timeout:g} s (inactivity_timeout)",
                                   "input_timeout_exceeded", 1008)
        else:
            await websocket.send_json({"isFinal": True})
            await websocket.close(code=1000)
            server.metrics.outcome("text_stream", "done")
    except (WebSocketDisconnect, RuntimeError, OSError):  # gone before the last words
        server.metrics.outcome("text_stream", "closed")
    finally:
        receiver.cancel()
        text.cancel()
        server.stream_ended(sid, release=True)  # a speaker cancelled before it began never released it


def _message(raw: str | None) -> dict | str:
    """A text message, or what is wrong with it (a binary one among them)."""
    message = json_object(raw)
    if message is None:
        return 'messages must be JSON objects: {"text": "..."} (and "flush": true), {"text": ""} to end'
    if "text" not in message and not message.get("flush"):
        return f"a message needs 'text' (or \"flush\": true); got keys {sorted(message)[:8]}"
    if "text" in message and not isinstance(message["text"], str):
        return "'text' must be a string"
    if "text" in message and (problem := checked_text(message["text"], "text")):
        return problem
    return message
