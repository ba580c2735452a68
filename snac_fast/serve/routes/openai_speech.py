"""``POST /v1/audio/speech``: OpenAI's speech API over the LM and the backend.

The body is checked first (:class:`~snac_fast.serve.routes.protocol.SpeechRequest`), then spoken
(:func:`~snac_fast.serve.routes.responses.spoken_response`).
"""

from __future__ import annotations

import time

from snac_fast.serve.routes.protocol import RequestError, SpeechRequest
from snac_fast.serve.routes.responses import json_body, spoken_response
from snac_fast.serve.services.formats import FLOAT_FORMATS, FORMATS
from snac_fast.serve.services.speech import FirstAudioTimes


def error_response(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                   **headers):
    """An error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return _error(RequestError(message, status=status, kind=kind, code=code), **headers)


def _error(error: RequestError, **headers):
    from starlette.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status, headers=headers)



async def speech(request):
    """The route."""
    times = FirstAudioTimes(time.perf_counter())
    server = request.app.state.server
    body = await json_body(request)
    try:
        if body is None:
            raise RequestError("the body must be JSON")
        speech_request = SpeechRequest.parse(body, server.voices, server.settings.http.max_input_chars)
    except RequestError as e:
        server.metrics.outcome("speech", "bad_request")
        return _error(e)
    fmt = (FLOAT_FORMATS if speech_request.sample_format == "f32" else FORMATS)[speech_request.response_format]
    return await spoken_response(request, speech_request, fmt, times, error_response)
