"""Property-based (hypothesis): the speech body, the ids WebSocket and the text WebSocket fed
arbitrary input. Each gets audio or a clear error in bounded time, the server stays healthy, and
every stream slot comes back."""

import asyncio
import json
import time

import httpx
import pytest
from helpers import NARROW
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import serving

from snac_fast import FastSNAC
from snac_fast.model.synthetic import synthetic_model

BOUND_S = 30.0  # every answer, audio or error, within this
FIELDS = ["input", "voice", "model", "response_format", "speed", "instructions", "stream_format", "sample_rate",
          "sample_format", "seed", "stream"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True),
                    st.text(max_size=40), st.sampled_from(["mp3", "pcm", "wav", "tara", "sse", "f32", "opus", "x"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=4), max_leaves=8)
bodies = st.one_of(st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10), values, max_size=6),
                   st.fixed_dictionaries({"input": st.text(min_size=1, max_size=60)},
                                         optional={k: values for k in FIELDS[1:]}), values)
HYPOTHESIS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def live():
    codec = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu", fuse=False)
    with serving(codec, idle_timeout_s=5.0, ws_idle_timeout_s=5.0) as (server, lm, state):
        lm.frames = 6
        yield server, state
        deadline = time.monotonic() + 10
        while state.backend.open_streams and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(server.url + "/health").json()
        assert health["status"] == "ok" and health["open_streams"] == 0 and health["slots_in_use"] == 0, health
        assert state.owners.open == {}


@pytest.mark.heavy
@HYPOTHESIS
@given(body=bodies, raw=st.one_of(st.none(), st.binary(max_size=64)))
def test_any_speech_body_gets_audio_or_a_clear_error(live, body, raw):
    server, _ = live
    started = time.monotonic()
    content = raw if raw is not None else json.dumps(body).encode()
    r = httpx.post(server.url + "/v1/audio/speech", content=content, timeout=BOUND_S,
                   headers={"Content-Type": "application/json"})
    assert time.monotonic() - started < BOUND_S
    if r.status_code == 200:
        assert r.content  # audio of the asked format (every format has bytes for six frames)
    else:
        assert r.status_code in (400, 413, 422, 429, 502, 503), r.status_code
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"]


ids = st.lists(st.one_of(st.integers(128266 + k * 4096, 128266 + k * 4096 + 4095) for k in range(7)) | st.integers(),
               max_size=30)
id_messages = st.lists(st.one_of(ids.map(lambda i: json.dumps({"ids": i})), values.map(json.dumps),
                                 st.binary(max_size=40), st.text(max_size=30)), max_size=8)


def exchange(url: str, messages: list) -> tuple[list, int | None]:
    """Send every message on a WebSocket, then read until the server closes: (replies, close code);
    within BOUND_S in all."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    async def talk():
        async with connect(url, max_size=None) as ws:
            for message in messages:
                await ws.send(message)
            replies = []
            try:
                while True:
                    replies.append(await asyncio.wait_for(ws.recv(), BOUND_S))
            except ConnectionClosed:
                pass
            return replies, ws.close_code
    return asyncio.run(asyncio.wait_for(talk(), BOUND_S))


@pytest.mark.heavy
@HYPOTHESIS
@given(messages=id_messages)
def test_any_ids_websocket_messages_get_audio_or_errors_then_done(live, messages):
    server, _ = live
    replies, code = exchange(server.url.replace("http", "ws") + "/v1/audio/stream",
                             [*messages, json.dumps({"end": True})])
    texts = [json.loads(r) for r in replies if isinstance(r, str)]
    assert all(t["type"] in ("error", "done") and (t["type"] == "done" or t["message"]) for t in texts)
    assert code in (1000, 1011) and (code == 1011 or texts[-1] == {"type": "done"})


text_messages = st.lists(st.one_of(st.text(max_size=50).map(lambda t: json.dumps({"text": t})),
                                   st.text(max_size=30).map(lambda t: json.dumps({"text": t + ". ", "flush": True})),
                                   values.map(json.dumps), st.text(max_size=20)), max_size=6)


@pytest.mark.heavy
@HYPOTHESIS
@given(messages=text_messages)
def test_any_text_websocket_messages_get_audio_or_errors_then_final(live, messages):
    server, _ = live
    url = server.url.replace("http", "ws") + "/v1/text-to-speech/tara/stream-input?output_format=pcm_16000"
    replies, code = exchange(url, [json.dumps({"text": " "}), *messages, json.dumps({"text": ""})])
    replies = [json.loads(r) for r in replies]
    assert all(("audio" in r) or ("isFinal" in r) or (r.get("error") and r.get("message")) for r in replies)
    assert code == 1000 and replies[-1] == {"isFinal": True}, (code, replies[-3:])


context_ids = st.sampled_from(["a", "b", "c"]) | st.none() | values
context_messages = st.lists(st.one_of(
    st.builds(lambda t, c: json.dumps({"text": t, "context_id": c}), st.text(max_size=40), context_ids),
    st.builds(lambda t, c: json.dumps({"text": t + ". ", "context_id": c, "flush": True}), st.text(max_size=20), context_ids),
    st.builds(lambda c: json.dumps({"context_id": c, "close_context": True}), context_ids),
    values.map(json.dumps), st.text(max_size=20)), max_size=8)


@pytest.mark.heavy
@HYPOTHESIS
@given(messages=context_messages)
def test_any_multi_context_messages_get_audio_or_errors_then_each_context_final(live, messages):
    server, _ = live
    url = server.url.replace("http", "ws") + "/v1/text-to-speech/tara/multi-stream-input?output_format=pcm_16000"
    replies, code = exchange(url, [*messages, json.dumps({"close_socket": True})])
    replies = [json.loads(r) for r in replies]
    assert all(("audio" in r and "contextId" in r) or r.get("isFinal") or (r.get("error") and r.get("message"))
               for r in replies)
    finals = [r["contextId"] for r in replies if r.get("isFinal")]
    for context in {r["contextId"] for r in replies if "audio" in r}:  # every context that spoke ended
        assert context in finals
        last_audio = max(k for k, r in enumerate(replies) if "audio" in r and r["contextId"] == context)
        assert last_audio < max(k for k, r in enumerate(replies) if r.get("isFinal") and r["contextId"] == context)
    assert code in (1000, 1008), (code, replies[-3:])  # 1008: a sixth context, or too many messages


@pytest.mark.heavy
@HYPOTHESIS
@given(body=bodies, raw=st.one_of(st.none(), st.binary(max_size=64)),
       output_format=st.sampled_from(["pcm_16000", "mp3_22050_32", "ulaw_8000", "wav", ""]))
def test_any_elevenlabs_speech_body_gets_audio_or_a_clear_error(live, body, raw, output_format):
    server, _ = live
    if isinstance(body, dict) and "input" in body:
        body["text"] = body.pop("input")
    content = raw if raw is not None else json.dumps(body).encode()
    r = httpx.post(server.url + "/v1/text-to-speech/tara/stream", content=content, timeout=BOUND_S,
                   params={"output_format": output_format}, headers={"Content-Type": "application/json"})
    if r.status_code == 200:
        assert r.content
    else:
        assert r.status_code in (400, 413, 429, 502, 503), r.status_code
        detail = r.json()["detail"]
        assert isinstance(detail["message"], str) and detail["message"] and detail["status"]
