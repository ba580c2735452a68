"""The speech API's request and error shapes (OpenAI's ``POST /v1/audio/speech``, its models and
voices lists), checked before any stream opens.

Request fields, as OpenAI documents them: ``input`` (at most the server's ``--max-input-chars``),
``model``, ``voice``, ``response_format`` (``mp3``, the default, ``opus``, ``aac``, ``flac``,
``wav``, ``pcm``; also ``pcm_8000`` ... ``pcm_48000``, ``ulaw_8000``, ``alaw_8000``), ``speed``
(0.25-4.0: FFmpeg's ``atempo``, the pitch kept; 1.0 leaves the audio as decoded),
``instructions`` (accepted, unused: an Orpheus LM takes no instructions), ``stream_format``
(``audio`` or ``sse``). Extensions:
``sample_rate`` (the output rate, for the formats without a fixed one), ``sample_format`` (``s16``
or ``f32``, for ``pcm`` and ``wav``), ``seed`` (the decoder's noise), ``stream`` (false: the whole
audio in one response with its true length, a WAV header's sizes included).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from snac_fast.serve.lm.presets import Voices
from snac_fast.serve.routes.schema import SpeechBody, first_problem
from snac_fast.serve.services.formats import ENCODER_RATES, FORMATS

DEFAULT_FORMAT = "mp3"  # OpenAI's default
# OpenAI's speech model names, accepted as names of this server's model
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")


def json_or_none(raw: str | bytes | None):
    """``raw`` parsed as JSON, or None where it is not JSON: malformed, not UTF-8, or nested past
    Python's recursion limit (a 2 KB body of ~1,000 brackets raised RecursionError: a 500)."""
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def checked_text(text: str, name: str) -> str | None:
    """What is wrong with a text field that the LM is to speak, or None: a lone surrogate (JSON's
    "\\ud800" parses to one) cannot go to the LM as UTF-8, and it is the client's error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"'{name}' is not valid Unicode: a lone surrogate {text[e.start]!r} at character {e.start}"
    return None


class RequestError(ValueError):
    """A request the server refuses: ``status`` and OpenAI's error ``type``, ``param`` and ``code``."""

    def __init__(self, message: str, *, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class SpeechRequest:
    """A checked speech request."""

    text: str
    voice: str
    model: str | None
    response_format: str
    sample_rate: int | None
    sample_format: str
    stream_format: str
    stream: bool
    seed: int | None
    speed: float = 1.0

    @classmethod
    def parse(cls, body, voices: Voices, max_chars: int) -> "SpeechRequest":
        """Check a request's JSON body; raises :class:`RequestError` naming the first problem. Each
        field's type and range: :class:`snac_fast.serve.routes.schema.SpeechBody` (what /openapi.json
        shows); here, what depends on the server's settings or on several fields."""
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        problem = first_problem(SpeechBody, body)
        if problem is not None:
            raise RequestError(problem[0], param=problem[1])
        text = body["input"]
        if not text.strip():
            raise RequestError("'input' must be a non-empty string", param="input")
        if len(text) > max_chars:
            raise RequestError(f"'input' is {len(text)} characters; at most {max_chars}", param="input",
                               code="string_above_max_length")
        problem = checked_text(text, "input")
        if problem:
            raise RequestError(problem, param="input")
        voice = body.get("voice") or voices.default
        if isinstance(voice, dict):  # OpenAI's custom-voice form {"id": ...}
            voice = voice["id"]
        problem = voices.problem(voice)
        if problem is not None:
            raise RequestError(f"'voice' {problem}", param="voice")
        name = body.get("response_format", DEFAULT_FORMAT)
        speed = float(body.get("speed", 1.0))
        stream_format = body.get("stream_format", "audio")
        sample_format = body.get("sample_format", "s16")
        if sample_format != "s16" and name not in ("pcm", "wav"):
            raise RequestError("'sample_format' f32 is for 'pcm' and 'wav' only", param="sample_format")
        rate = body.get("sample_rate")
        if rate is not None:
            if FORMATS[name].rate is not None and rate != FORMATS[name].rate:
                raise RequestError(f"'{name}' is at {FORMATS[name].rate} Hz; drop 'sample_rate'", param="sample_rate")
            if name in ENCODER_RATES and rate not in ENCODER_RATES[name]:
                raise RequestError(f"{name} takes 'sample_rate' {list(ENCODER_RATES[name])}", param="sample_rate")
            if sample_format == "f32":
                raise RequestError("'sample_rate' needs sample_format s16", param="sample_rate")
        stream = body.get("stream", True)
        if not stream and stream_format == "sse":
            raise RequestError("'stream' false cannot be an SSE stream", param="stream")
        return cls(text, voice, body.get("model"), name, rate, sample_format, stream_format, stream, body.get("seed"),
                   speed)


def models_list(models: tuple[str, ...]) -> dict:
    """``GET /v1/models`` in OpenAI's shape."""
    return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "snac-fast"} for m in models]}


def voices_list(voices: tuple[str, ...]) -> dict:
    """``GET /v1/audio/voices``: the voices, as Kokoro-FastAPI's list and with their names."""
    return {"voices": list(voices), "data": [{"id": v, "name": v} for v in voices]}
