"""What an outside probe of `snac-fast serve` broke (issue 88), one test a finding: credentials in
/health and errors, plain-text 500s from nested JSON, huge numbers and a hostile LM's answers, an
LM answer without audio taken for success, a lone surrogate blamed on the LM, an LM that keeps its
connection alive without audio, and one that never stops."""

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
from helpers import NARROW
from live_server import LiveServer

from snac_fast import FastSNAC
from snac_fast.model.synthetic import synthetic_model
from snac_fast.orpheus import ORPHEUS
from snac_fast.serve import ServeSettings, create_app
from snac_fast.serve.access.limits import uvicorn_options

PASSWORD = "s3cret-lm-password"
KEY = "server-key"
FRAME = [ORPHEUS.offset + k * ORPHEUS.codebook_size + 7 for k in range(ORPHEUS.frame_size)]
AUDIO_TEXT = "".join(f"<custom_token_{i - 128256}>" for i in FRAME)  # one frame of audio tokens


def _events(*texts: str) -> bytes:
    return b"".join(b"data: " + json.dumps({"choices": [{"text": t}]}).encode() + b"\n\n" for t in texts)


# the probe's LM answers, keyed by the request's text (what follows "voice: " in the prompt)
ANSWERS = {
    "bad utf8": ("text/event-stream", _events(AUDIO_TEXT * 6) + b"data: {\"choices\": [{\"text\": \"\xff\xfe\"}]}\n\n"),
    "text is a number": ("text/event-stream", b'data: {"choices": [{"text": 5}]}\n\n'),
    "choice is a list": ("text/event-stream", b'data: {"choices": [["<custom_token_10>"]]}\n\n'),
    "huge token": ("text/event-stream", _events(AUDIO_TEXT * 4, "<custom_token_" + "9" * 5000 + ">")),
    "nested chunk": ("text/event-stream", b"data: " + b"[" * 5000 + b"\n\n"),
    "json completion": ("application/json", json.dumps({"choices": [{"text": AUDIO_TEXT * 4}]}).encode()),
    "html page": ("text/html", b"<html><body>It works!</body></html>"),
    "nothing": ("text/event-stream", b""),
}


class HostileLM:
    """An LM that answers each text as the probe's did: :data:`ANSWERS`, or for "keep alive" SSE
    comments every 0.1 s with no audio, for "never stops" audio tokens without an end, for "slow" a
    frame every 0.5 s, for "silent start" the same after 5 s of nothing."""

    def __init__(self) -> None:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        async def completions(request):
            body = await request.json()
            text = body["prompt"].split(": ", 1)[-1].split("<|eot_id|>")[0]
            if text == "keep alive":
                async def comments():
                    for _ in range(600):
                        yield b": ping\n\n"
                        await asyncio.sleep(0.1)
                return StreamingResponse(comments(), media_type="text/event-stream")
            if text == "never stops":
                async def forever():
                    while True:
                        yield _events(AUDIO_TEXT * 8)
                        await asyncio.sleep(0)
                return StreamingResponse(forever(), media_type="text/event-stream")
            if text in ("slow", "silent start"):
                async def slowly():
                    if text == "silent start":
                        await asyncio.sleep(5)
                    for _ in range(12):
                        yield _events(AUDIO_TEXT)
                        await asyncio.sleep(0.5)
                return StreamingResponse(slowly(), media_type="text/event-stream")
            media, content = ANSWERS[text]
            return Response(content, media_type=media)

        async def models(request):
            return JSONResponse({"object": "list", "data": []})

        self.app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/v1/models", models)])


@contextlib.contextmanager
def probed_server(**options):
    codec = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu", fuse=False)
    with LiveServer(HostileLM().app) as lm:
        url = lm.url.replace("http://", f"http://probe:{PASSWORD}@") + "/v1"
        settings = ServeSettings.of(lm_url=url, lm_model="orpheus", **options)
        with LiveServer(create_app(codec, settings), **uvicorn_options(settings.http)) as server:
            yield server


@pytest.fixture(scope="module")
def server():
    with probed_server(lm_timeout_s=1.0, max_tokens=7 * 12, header_timeout_s=2.0) as server:
        yield server


@pytest.fixture(scope="module")
def keyed_server():
    with probed_server(api_key=KEY) as server:
        yield server


def speak(server, text: str, fmt: str = "pcm", timeout: float = 30, headers=None, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/audio/speech", json={"input": text, "response_format": fmt, **body},
                      timeout=timeout, headers=headers)


def test_urls_are_shown_without_credentials_or_query():
    from snac_fast.serve.lm.client import redacted_url

    assert redacted_url("http://user:pw@lm.local:8000/v1?key=k#f") == "http://lm.local:8000/v1"
    assert redacted_url("https://[::1]:9/v1") == "https://[::1]:9/v1"
    assert redacted_url("http://plain/v1") == "http://plain/v1"


def test_health_says_only_its_status_without_the_key(keyed_server):
    open_answer = httpx.get(keyed_server.url + "/health").json()
    assert open_answer == {"status": "ok"}
    keyed = httpx.get(keyed_server.url + "/health", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert keyed["status"] == "ok" and "pid" in keyed and keyed["lm"]["url"].startswith("http://127.0.0.1:")
    assert PASSWORD not in json.dumps(keyed)


@pytest.mark.parametrize("text", sorted(ANSWERS))
def test_an_lm_answer_that_is_not_audio_is_a_502_in_openai_shape(server, text):
    """Bad UTF-8, wrong types, a 5,000-digit token, nested JSON, a whole JSON completion, a page,
    nothing: each a 502 with OpenAI's error body naming the LM (never a plain-text 500 or an empty
    200), the LM's credentials not in it."""
    r = speak(server, text, stream=False)
    assert r.status_code == 502, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["type"] == "lm_output_error" and "language model" in error["message"], error
    assert PASSWORD not in r.text


def test_a_streamed_answer_that_turns_bad_ends_with_an_error_event(server):
    """Audio went out before the LM's bad bytes: the SSE stream ends with an error event."""
    with httpx.stream("POST", server.url + "/v1/audio/speech", timeout=30,
                      json={"input": "bad utf8", "response_format": "pcm", "stream_format": "sse"}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200
    assert events[0]["type"] == "speech.audio.delta" and events[-1]["type"] == "error", events[-1]
    assert PASSWORD not in json.dumps(events[-1])


def test_an_lm_that_sends_comments_but_no_audio_times_out(server):
    r = speak(server, "keep alive", stream=False)
    assert r.status_code == 502 and "no audio token for 1 s" in r.json()["error"]["message"]


def test_max_tokens_is_enforced_on_an_lm_that_never_stops(server):
    r = speak(server, "never stops", stream=False)
    assert r.status_code == 200
    samples = len(r.content) // 2
    assert 0 < samples <= 12 * 2048, samples  # 12 frames of 2,048 samples at most


@pytest.mark.parametrize("route", ["/v1/audio/speech", "/v1/text-to-speech/tara/stream", "/v1/text-to-speech/tara"])
def test_nested_json_is_a_400(server, route):
    r = httpx.post(server.url + route, content=b"[" * 50000 + b"]" * 50000, timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text[:200]


def test_an_output_format_of_5000_digits_is_a_400(server):
    r = httpx.post(server.url + "/v1/text-to-speech/tara?output_format=mp3_" + "4" * 5000 + "_128",
                   json={"text": "Hi."}, timeout=30)
    assert r.status_code == 400 and "output_format" in r.json()["detail"]["message"]


def test_a_lone_surrogate_is_the_clients_400_not_the_lms_502(server):
    r = httpx.post(server.url + "/v1/audio/speech", content=b'{"input": "Hi \\ud800 there."}', timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input" and "surrogate" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/text-to-speech/tara", content=b'{"text": "Hi \\udfff."}', timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["detail"]["message"]


def test_websockets_answer_nested_json_with_an_error_message(server):
    from websockets.sync.client import connect

    ws_url = server.url.replace("http", "ws")
    with connect(ws_url + "/v1/audio/stream") as ws:
        ws.send("[" * 5000)
        reply = json.loads(ws.recv(timeout=10))
        assert reply["type"] == "error" and "JSON" in reply["message"]
    with connect(ws_url + "/v1/text-to-speech/tara/stream-input?output_format=pcm_24000") as ws:
        ws.send("[" * 5000)
        reply = json.loads(ws.recv(timeout=10))
        assert reply.get("isFinal") is None and reply["error"] == "invalid_message", reply


def test_one_large_ids_message_does_not_stall_the_server(server):
    """An ids message of 600 frames (inside the message size limit) is decoded a piece at a time:
    /health answers while it is (it waited for the whole message: 22.7 s at 2,000 frames)."""
    from websockets.sync.client import connect

    frames = 600
    ids = [FRAME[k] - 7 + (f * 13 + k) % ORPHEUS.codebook_size for f in range(frames) for k in range(7)]
    answers, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            asked = time.monotonic()
            httpx.get(server.url + "/health", timeout=120)
            answers.append((asked, time.monotonic()))

    poller = threading.Thread(target=poll)
    with connect(server.url.replace("http", "ws") + "/v1/audio/stream", max_size=None) as ws:
        poller.start()
        sent = time.monotonic()
        ws.send(json.dumps({"ids": ids}))
        audio = ws.recv(timeout=300)
        took = time.monotonic() - sent
        stop.set()
        poller.join()
    assert isinstance(audio, bytes) and len(audio) >= 2 * (frames - 3) * 2048  # s16; the lookahead held back
    waits = [answered - asked for asked, answered in answers if sent <= asked <= sent + took]
    assert len(waits) >= 3 and max(waits) < took / 3, (took, sorted(waits)[-3:])


def _slots_free_within(server, seconds: float, headers=None) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if httpx.get(server.url + "/health", headers=headers).json()["slots_in_use"] == 0:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("route", ["stream-input", "multi-stream-input"])
def test_text_without_sentence_ends_is_bounded_per_stream(server, route):
    """Messages of 100,000 characters and no sentence end: past --max-input-chars waiting to be
    spoken the stream is refused by name, at once, and its slot comes back (a flood of them kept a
    server busy for a minute after its client left)."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    url = server.url.replace("http", "ws") + f"/v1/text-to-speech/tara/{route}?output_format=pcm_24000"
    replies, started = [], time.monotonic()
    # max_queue None: replies left unread would otherwise stop this client reading, so that it missed
    # the server's close reply and waited its 10 s close timeout
    with connect(url, max_size=None, max_queue=None) as ws:
        with contextlib.suppress(ConnectionClosed):
            for _ in range(10):
                ws.send(json.dumps({"text": "word " * 20000, "context_id": "c"}))
        with contextlib.suppress(ConnectionClosed, TimeoutError):
            while not any(r.get("error") for r in replies):
                replies.append(json.loads(ws.recv(timeout=10)))
    errors = [r for r in replies if r.get("error")]
    assert errors and errors[0]["error"] == "text_backlog_exceeded" and "--max-input-chars" in errors[0]["message"]
    assert time.monotonic() - started < 30  # loose for a loaded CI host: the flood's work took minutes
    assert _slots_free_within(server, 1.0)


@pytest.mark.parametrize("text, stream", [("slow", False), ("silent start", False), ("silent start", True)])
def test_a_departed_clients_slot_comes_back_within_a_second(keyed_server, text, stream):
    """A client that leaves before its first audio, or before a whole file ("stream": false) is
    made, frees its stream's slot at once (it was held until the audio's end or the idle timeout).
    The server's --lm-timeout is 60 s: the LM's silence does not end the request first."""
    key = {"Authorization": f"Bearer {KEY}"}
    with pytest.raises(httpx.TimeoutException):
        speak(keyed_server, text, stream=stream, timeout=1.0, headers=key)
    left = time.monotonic()
    assert _slots_free_within(keyed_server, 1.0, key), f"a slot held {time.monotonic() - left:.1f} s after the client left"


def _raw_exchange(server, request: bytes, wait_s: float) -> bytes:
    """Send raw bytes, then read what comes back until the server closes or ``wait_s`` pass."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait_s) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(request)
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                answer += chunk
    return answer


def test_a_body_that_never_arrives_gets_a_408(server):
    started = time.monotonic()
    answer = _raw_exchange(server, b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                   b"Content-Length: 100\r\n\r\n{\"input\": ", wait_s=20)
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer[:200]
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("fmt", ["mp3", "aac"])
def test_a_sample_rate_the_encoder_cannot_open_is_a_400_and_holds_no_slot(server, fmt):
    """Schemathesis found it: mp3 at sample_rate 12260 passed the checks, LAME refused it after the
    stream was opened: a plain-text 500 and a slot held for good. Each encoder's rates are checked
    now, and the encoder opens before the stream does."""
    answer = speak(server, "Hi.", fmt, sample_rate=12260)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "sample_rate"
    assert f"{fmt} takes 'sample_rate'" in answer.json()["error"]["message"]
    assert speak(server, "never stops", fmt, sample_rate=22050).headers.get("x-sample-rate") == "22050"  # audio, cut at max_tokens


def test_a_connection_kept_past_httpxs_five_seconds_still_takes_requests(server):
    """A client's pooled connection idle 6 s (past httpx's 5 s keep-alive, which equalled uvicorn's
    default and so raced it: the soak's rare "connection reset" and "cannot write request body")
    still takes the next request: the server keeps idle connections --keep-alive-timeout (75 s)."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        for wait in (0, 6):
            time.sleep(wait)
            connection.request("GET", "/health")
            answer = connection.getresponse()
            assert answer.status == 200 and answer.read()
    finally:
        connection.close()


def test_headers_past_64_kib_get_a_431(server):
    answer = _raw_exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n",
                           wait_s=20)
    assert answer.startswith(b"HTTP/1.1 431") and b"headers_too_large" in answer, answer[:200]


EVIL = "http://evil.example"


def test_another_sites_page_is_refused_and_the_servers_own_page_is_not(server):
    """A cross-origin text/plain POST needs no preflight: a page anywhere made a keyless server
    speak, and opened its WebSockets. Now a browser's request from another origin gets a 403."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    r = httpx.post(server.url + "/v1/audio/speech", content=json.dumps({"input": "slow"}), timeout=30,
                   headers={"Content-Type": "text/plain", "Origin": EVIL})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    with pytest.raises(InvalidStatus) as refused:
        connect(server.url.replace("http", "ws") + "/v1/audio/stream", origin=EVIL)
    assert refused.value.response.status_code == 403
    assert httpx.get(server.url + "/v1/audio/voices", headers={"Origin": server.url}).status_code == 200
    with connect(server.url.replace("http", "ws") + "/v1/audio/stream", origin=server.url) as ws:
        ws.send(json.dumps({"end": True}))
        assert json.loads(ws.recv(timeout=10))["type"] == "done"


def test_allowed_origins_get_cors_answers_before_the_key():
    with probed_server(api_key=KEY, allow_origins="http://app.example") as server:
        preflight = httpx.options(server.url + "/v1/audio/speech", headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://app.example"
        r = httpx.get(server.url + "/v1/audio/voices", headers={"Origin": "http://app.example",
                                                                "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        assert httpx.get(server.url + "/v1/audio/voices", headers={"Origin": EVIL,
                                                                   "Authorization": f"Bearer {KEY}"}).status_code == 403


def test_the_page_has_a_content_security_policy_and_keeps_no_key_for_good(server):
    r = httpx.get(server.url + "/")
    policy = r.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in policy and "script-src 'sha256-" in policy and "unsafe-inline" not in policy
    assert r.headers["x-frame-options"] == "DENY" and "localStorage" not in r.text
