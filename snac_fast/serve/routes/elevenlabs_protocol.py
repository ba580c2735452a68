"""What ElevenLabs' two text-in WebSockets share (their API reference, "WebSocket" and "Multi-Context
WebSocket"; their Python SDK's message types): the ``output_format`` names, ``inactivity_timeout``,
the audio and error messages, and the checks a connection passes before it is served."""

from __future__ import annotations

import base64
import dataclasses
import re

from snac_fast.serve.engine.client import EngineLostError
from snac_fast.serve.lm.client import LMOutputError
from snac_fast.serve.routes.protocol import json_or_none
from snac_fast.serve.services.formats import ENCODER_RATES, FORMATS, AudioFormat, checked_speed

DEFAULT_OUTPUT_FORMAT = "mp3_44100_128"  # ElevenLabs' default
INACTIVITY_TIMEOUT_S = (20.0, 180.0)  # ElevenLabs' default and largest
_MP3 = re.compile(r"mp3_(\d{1,6})_(\d{1,4})")  # bounded: int() of 5,000 digits raises


def elevenlabs_format(name: str) -> AudioFormat | None:
    """An ElevenLabs ``output_format`` name as this server's format, or None if not served."""
    if name in ("ulaw_8000", "alaw_8000") or name.startswith("pcm_") and name in FORMATS:
        return FORMATS[name]
    match = _MP3.fullmatch(name)
    if match and int(match[1]) in ENCODER_RATES["mp3"] and 8 <= int(match[2]) <= 320:
        return dataclasses.replace(FORMATS["mp3"], name=name, rate=int(match[1]), bit_rate=int(match[2]) * 1000)
    return None


def voice_speed(settings) -> float:
    """``voice_settings.speed`` (absent or null: 1.0), which this server honours as OpenAI's
    ``speed`` (FFmpeg's ``atempo``); ValueError naming what is wrong with it."""
    speed = settings.get("speed") if isinstance(settings, dict) else None
    return 1.0 if speed is None else checked_speed(speed, "voice_settings.speed")


def inactivity_timeout(text: str | None) -> float | None:
    """The query's ``inactivity_timeout`` in seconds (default 20), or None when out of range."""
    if text is None:
        return INACTIVITY_TIMEOUT_S[0]
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 1 <= value <= INACTIVITY_TIMEOUT_S[1] else None


def connection_problem(websocket) -> tuple[str | None, AudioFormat | None, float | None]:
    """(what is wrong with the connection's path and query, or None; its format; its timeout)."""
    voice = websocket.path_params["voice_id"]
    fmt = elevenlabs_format(websocket.query_params.get("output_format", DEFAULT_OUTPUT_FORMAT))
    timeout = inactivity_timeout(websocket.query_params.get("inactivity_timeout"))
    problem = None
    voice_problem = websocket.app.state.server.voices.problem(voice)
    if voice_problem is not None:
        problem = f"voice_id {voice_problem}"
    elif fmt is None:
        problem = ("output_format must be pcm_8000 ... pcm_48000, ulaw_8000, alaw_8000 or mp3_<rate>_<kbps>, got "
                   f"{websocket.query_params.get('output_format')!r}")
    elif timeout is None:
        problem = f"inactivity_timeout must be 1-{INACTIVITY_TIMEOUT_S[1]:g} seconds"
    return problem, fmt, timeout


def json_object(raw: str | None) -> dict | None:
    """A WebSocket text message as a JSON object, or None (not JSON, not an object, or binary)."""
    message = json_or_none(raw)
    return message if isinstance(message, dict) else None


def audio_message(data: bytes, **context) -> dict:
    """An audio reply (no word timings); ``context``: the multi-context reply's ``contextId``."""
    return {"audio": base64.b64encode(data).decode(), "isFinal": None, "normalizedAlignment": None,
            "alignment": None, **context}


def error_message(message: str, error: str | None, code: int | None, **context) -> dict:
    return {"message": message, "error": error, "code": code, **context}


async def close_with_error(websocket, message: str, error: str | None, code: int | None) -> None:
    """The error as a message, then the close (the connection may be gone already)."""
    try:
        await websocket.send_json(error_message(message, error, code))
        await websocket.close(code=code, reason=message[:120])
    except (RuntimeError, OSError):
        pass


def error_kind(e: BaseException) -> str:
    """A speaker's failure as the error name a client reads."""
    return "engine_unavailable" if isinstance(e, EngineLostError) else \
        "lm_output_error" if isinstance(e, LMOutputError) else "engine_error"
