"""``POST /v1/text-to-speech/{voice_id}`` and ``.../stream``, each also ``.../with-timestamps``:
ElevenLabs' HTTP speech (their API reference, "Create speech", "Stream speech" and their "with
timestamps" forms; their Python SDK's ``text_to_speech.convert`` and ``.stream``, LiveKit's
``synthesize``, Pipecat's ``ElevenLabsHttpTTSService``), spoken as ``POST /v1/audio/speech`` is
(:func:`snac_fast.serve.routes.responses.spoken_response`). The "with timestamps" forms send JSON
(``{"audio_base64", "alignment": null, "normalized_alignment": null}``, a line per piece of audio
when streamed): this server has no character timings.

Honoured: the path's voice (a voice of the LM's preset, or of ``--voices``); the query's ``output_format`` (named as the
WebSockets name it, :func:`~snac_fast.serve.routes.elevenlabs_protocol.elevenlabs_format`; default
``mp3_44100_128``); the body's ``text`` (at most ``--max-input-chars``; a long one is spoken
segment by segment into one stream), ``seed`` (the decoder's noise) and ``voice_settings.speed``
(as OpenAI's ``speed``: FFmpeg's ``atempo``). Accepted and unused: ``model_id``, the rest of
``voice_settings``, ``language_code``, ``previous_text``, ``next_text``,
``optimize_streaming_latency`` and the rest. ``/stream`` sends the audio as it is made; without it,
the whole file in one response. Errors in ElevenLabs' shape: ``{"detail": {"status", "message"}}``.
"""

from __future__ import annotations

import time

from snac_fast.serve.routes.elevenlabs_protocol import DEFAULT_OUTPUT_FORMAT, elevenlabs_format, voice_speed
from snac_fast.serve.routes.protocol import SpeechRequest, checked_text
from snac_fast.serve.routes.responses import TIMESTAMPED, json_body, spoken_response
from snac_fast.serve.routes.schema import ElevenLabsSpeechBody, first_problem
from snac_fast.serve.services.speech import FirstAudioTimes


async def text_to_speech(request):
    """The route (both paths)."""
    times = FirstAudioTimes(time.perf_counter())
    server = request.app.state.server
    body = await json_body(request)
    name = request.query_params.get("output_format", DEFAULT_OUTPUT_FORMAT)
    fmt = elevenlabs_format(name)
    voice = request.path_params["voice_id"]
    problem, text, seed, speed = _checked(body, server.settings.http.max_input_chars)
    voice_problem = server.voices.problem(voice)
    if problem is None and voice_problem is not None:
        problem = f"voice_id {voice_problem}"
    if problem is None and fmt is None:
        problem = f"output_format must be pcm_8000 ... pcm_48000, ulaw_8000, alaw_8000 or mp3_<rate>_<kbps>, got {name!r}"
    if problem is not None:
        server.metrics.outcome("text_to_speech", "bad_request")
        return error_response(400, problem, "invalid_request")
    path = request.url.path.removesuffix("/with-timestamps")
    form = TIMESTAMPED if path != request.url.path else "audio"
    speech_request = SpeechRequest(text, voice, None, fmt.name, None, "s16", form, path.endswith("/stream"), seed, speed)
    return await spoken_response(request, speech_request, fmt, times, error_response, "text_to_speech")


def _checked(body, max_chars: int) -> tuple[str | None, str | None, int | None, float]:
    """(what is wrong with the body, or None; its text; its seed; its ``voice_settings.speed``).
    Each field's type and range: :class:`snac_fast.serve.routes.schema.ElevenLabsSpeechBody`."""
    failed = (None, None, 1.0)
    if not isinstance(body, dict):
        return "the body must be a JSON object with 'text'", *failed
    problem = first_problem(ElevenLabsSpeechBody, body)
    if problem is not None:
        return problem[0], *failed
    text = body["text"]
    if not text.strip():
        return "'text' must be a non-empty string", *failed
    if len(text) > max_chars:
        return f"'text' is {len(text)} characters; at most {max_chars}", *failed
    if problem := checked_text(text, "text"):
        return problem, *failed
    return None, text, body.get("seed"), voice_speed(body.get("voice_settings"))


def error_response(status: int, message: str, kind: str, code: str | None = None, **headers):
    """An error in ElevenLabs' shape."""
    from starlette.responses import JSONResponse

    return JSONResponse({"detail": {"status": code or kind, "message": message}}, status_code=status, headers=headers)
