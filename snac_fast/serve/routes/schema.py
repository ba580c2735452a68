"""The HTTP API's types, as the routes validate with them and as ``/openapi.json`` documents them
(one source: pydantic models): OpenAI's speech request and ElevenLabs' text-to-speech request, as
each publishes them, with this server's extensions; each protocol's error shape; the document
itself (OpenAPI 3.1), which ``/docs`` shows in Swagger UI.

The routes check each field's type and range here (:func:`first_problem`); what depends on the
server's settings (the voices, ``--max-input-chars``) or on several fields (a sample rate against
its format) stays in :mod:`snac_fast.serve.routes.protocol` and :mod:`snac_fast.serve.routes.elevenlabs_speech`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from snac_fast.serve.services.formats import FORMATS, SPEEDS

SAMPLE_FORMATS = ("s16", "f32")
STREAM_FORMATS = ("audio", "sse")
Int64 = Annotated[int, Field(strict=True, ge=-(1 << 63), lt=1 << 63)]
Speed = Annotated[float, Field(strict=True, ge=SPEEDS[0], le=SPEEDS[1])]
Text = Annotated[str, Field(strict=True)]


# one server-sent event of stream_format "sse", as a schema of the event's fields: its data is JSON,
# speech.audio.delta ({"type", "audio": base64 of the format}), speech.audio.done, or error
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "contentMediaType": "application/json",
             "description": '{"type": "speech.audio.delta", "audio": BASE64}, {"type": "speech.audio.done"} or '
                            '{"type": "error", "error": {"message", "type"}}'},
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}


class VoiceId(BaseModel):
    """OpenAI's custom-voice form of ``voice``."""

    model_config = ConfigDict(extra="allow")
    id: Text


class SpeechBody(BaseModel):
    """``POST /v1/audio/speech``: OpenAI's "Create speech" request (unknown fields are accepted and
    ignored, as newer clients send them), and this server's extensions (``sample_rate``,
    ``sample_format``, ``seed``, ``stream``)."""

    model_config = ConfigDict(extra="allow")
    input: Text = Field(description="The text to speak (at most the server's --max-input-chars characters; "
                                    "longer text is spoken sentence by sentence into one stream).")
    model: Optional[Text] = Field(None, description="The model's name: tts-1, tts-1-hd, gpt-4o-mini-tts or the LM's.")
    voice: Optional[Union[Text, VoiceId]] = Field(None, description="A voice of the LM's preset: GET /v1/audio/voices "
                                                                   "lists its names (Maya1 also takes a description, "
                                                                   "snorTTS ids like hindi159; default: --voice).")
    instructions: Optional[Text] = Field(None, description="Accepted, unused: an Orpheus LM takes no instructions.")
    response_format: Literal[tuple(FORMATS)] = Field("mp3", description="The audio's format.")  # type: ignore[valid-type]
    speed: Speed = Field(1.0, description="Playback speed, the pitch kept (FFmpeg's atempo).")
    stream_format: Literal[STREAM_FORMATS] = Field("audio", description="Raw audio, or server-sent events.")
    sample_rate: Optional[Annotated[int, Field(strict=True, ge=8000, le=48000)]] = Field(
        None, description="Output rate, for the formats without a fixed one (opus: 8000, 12000, 16000, 24000, 48000).")
    sample_format: Literal[SAMPLE_FORMATS] = Field("s16", description="f32 for pcm and wav only.")
    seed: Optional[Int64] = Field(None, description="The decoder's noise: the same seed, the same audio.")
    stream: Annotated[bool, Field(strict=True)] = Field(True, description="false: the whole file in one response, "
                                                                          "its sizes true.")


class VoiceSettings(BaseModel):
    """ElevenLabs' voice settings: ``speed`` is honoured (as OpenAI's), the rest accepted."""

    model_config = ConfigDict(extra="allow")
    stability: Optional[float] = None
    similarity_boost: Optional[float] = None
    style: Optional[float] = None
    use_speaker_boost: Optional[bool] = None
    speed: Optional[Speed] = None


class ElevenLabsSpeechBody(BaseModel):
    """``POST /v1/text-to-speech/{voice_id}[/stream][/with-timestamps]``: ElevenLabs' "Create
    speech" request; ``text``, ``seed`` and ``voice_settings.speed`` are honoured, the rest accepted."""

    model_config = ConfigDict(extra="allow")
    text: Text = Field(description="The text to speak (at most --max-input-chars characters).")
    model_id: Optional[Text] = None
    voice_settings: Optional[VoiceSettings] = None
    seed: Optional[Int64] = None
    language_code: Optional[Text] = None
    previous_text: Optional[Text] = None
    next_text: Optional[Text] = None


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class OpenAIError(BaseModel):
    """An error of the OpenAI routes (and of the key, limits and origin checks before any route)."""

    error: OpenAIErrorDetail


class ElevenLabsErrorDetail(BaseModel):
    status: str
    message: str


class ElevenLabsError(BaseModel):
    """An error of the ElevenLabs routes."""

    detail: ElevenLabsErrorDetail


def first_problem(model: type[BaseModel], body: Any) -> tuple[str, str | None] | None:
    """(what is wrong with ``body`` as ``model``, the field), or None: the first error, naming its
    field (``'seed': Input should be a valid integer``)."""
    try:
        model.model_validate(body)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        loc = [str(part) for part in error["loc"] if not isinstance(part, int)]
        if not loc:
            return "the body must be a JSON object", None
        field = ".".join(loc[:2]) if loc[0] == "voice_settings" else loc[0]
        if error["type"] == "missing":
            return f"'{field}' is required", loc[0]
        return f"'{field}': {error['msg']}, got {_shown(error.get('input'))}", loc[0]
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


AUDIO_TYPES = sorted({fmt.media_type for fmt in FORMATS.values()})


def _binary(types: list[str], description: str) -> dict:
    return {"description": description, "content": {t: {"schema": {"type": "string", "format": "binary"}} for t in types}}


def _errors(schema: str, statuses: dict[int, str]) -> dict:
    ref = {"$ref": f"#/components/schemas/{schema}"}
    return {str(status): {"description": why, "content": {"application/json": {"schema": ref}}}
            for status, why in statuses.items()}


# what any route may answer before it runs (the key, the origin, the body's size and time, headers)
_GUARDS = {401: "no or a wrong API key", 403: "a web origin not allowed (--allow-origins)",
           408: "the body did not arrive in time", 413: "the body is larger than --max-body-bytes",
           431: "the request's headers are too large"}
_SPEAKING = {400: "the request is not valid (the field is named)", 429: "too many open streams for this key",
             499: "the client left before its audio", 500: "the engine call failed",
             502: "the language model failed or sent no audio", 503: "the server is busy or its engine is gone"}


def openapi_document(server_url: str | None = None) -> dict:
    """The OpenAPI 3.1 document of every HTTP route (the WebSockets are in docs/http_server.md)."""
    from pydantic.json_schema import models_json_schema

    models = [SpeechBody, ElevenLabsSpeechBody, OpenAIError, ElevenLabsError]
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    schemas = defs["$defs"]

    def body(name: str) -> dict:
        return {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}

    openai_errors = _errors("OpenAIError", {**_SPEAKING, **_GUARDS})
    elevenlabs_errors = {**_errors("ElevenLabsError", _SPEAKING), **_errors("OpenAIError", _GUARDS)}
    plain_get = {**_errors("OpenAIError", {k: v for k, v in _GUARDS.items() if k in (401, 403, 431)})}
    voice_param = {"name": "voice_id", "in": "path", "required": True, "schema": {"type": "string"},
                   "description": "One of GET /v1/audio/voices."}
    format_param = {"name": "output_format", "in": "query", "required": False,
                    "schema": {"type": "string", "default": "mp3_44100_128"},
                    "description": "pcm_8000 ... pcm_48000, ulaw_8000, alaw_8000 or mp3_<rate>_<kbps>."}
    paths: dict[str, dict] = {
        "/v1/audio/speech": {"post": {
            "summary": "Speak text (OpenAI's speech API)", "operationId": "createSpeech",
            "requestBody": body(SpeechBody.__name__),
            "responses": {"200": {"description": "The audio (streamed unless stream is false), or server-sent "
                                                 "events with stream_format sse",
                                  "content": {**{t: {"schema": {"type": "string", "format": "binary"}}
                                                 for t in AUDIO_TYPES},
                                              "text/event-stream": {"schema": SSE_EVENT}}},
                          **openai_errors}}},
    }
    for form, summary in [("", "Speak text (ElevenLabs)"), ("/stream", "Speak text as a stream (ElevenLabs)"),
                          ("/with-timestamps", "Speak text as JSON (ElevenLabs; no timings)"),
                          ("/stream/with-timestamps", "Speak text as a stream of JSON lines (ElevenLabs)")]:
        ok = _binary(AUDIO_TYPES, "The audio") if "timestamps" not in form else \
            {"description": "audio_base64 with null alignments", "content": {"application/json": {"schema": {}}}}
        paths[f"/v1/text-to-speech/{{voice_id}}{form}"] = {"post": {
            "summary": summary, "operationId": "elevenLabs" + "".join(p.title() for p in form.replace("-", "/").split("/")),
            "parameters": [voice_param, format_param], "requestBody": body(ElevenLabsSpeechBody.__name__),
            "responses": {"200": ok, **elevenlabs_errors}}}
    json_ok = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
    for path, summary in [("/v1/audio/voices", "The voices"), ("/v1/models", "The models (OpenAI's list)")]:
        paths[path] = {"get": {"summary": summary, "responses": {"200": json_ok, **plain_get}}}
    paths["/health"] = {"get": {"summary": "Liveness (only the status without the key)",
                                "responses": {"200": json_ok, "503": json_ok, **plain_get}}}
    paths["/ready"] = {"get": {"summary": "Readiness: the engine serves and the LM answers",
                               "responses": {"200": json_ok, "503": json_ok, **plain_get}}}
    paths["/metrics"] = {"get": {"summary": "Prometheus metrics", "responses": {
        "200": {"description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **plain_get}}}
    paths["/"] = {"get": {"summary": "A page to try the server", "responses": {
        "200": {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}}, **plain_get}}}
    document = {
        "openapi": "3.1.0",
        "info": {"title": "snac-fast serve", "version": _version(),
                 "description": "OpenAI's and ElevenLabs' speech APIs over an Orpheus-style LM and the SNAC "
                                "decoder. WebSockets (/v1/audio/stream, /v1/text-to-speech/{voice_id}/stream-input, "
                                "/multi-stream-input) are described in docs/http_server.md."},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"},
            "xi-api-key": {"type": "apiKey", "in": "header", "name": "xi-api-key"}}},
        "security": [{"bearer": []}, {"xi-api-key": []}, {}],
    }
    if server_url:
        document["servers"] = [{"url": server_url}]
    return document


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("snac-fast")
    except PackageNotFoundError:
        return "0"
