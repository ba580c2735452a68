"""`WS /v1/text-to-speech/{voice}/stream-input` (ElevenLabs' stream-input shapes): text in as it is
written, audio out before it ends, every sentence one LM request into the connection's one stream.
A client written from their published protocol, and their own Python SDK over TLS."""

import asyncio
import base64
import json
import subprocess

import numpy as np
import pytest
from helpers import joined_pcm, quiet_codec, random_codes
from live_server import serving


SENTENCES = ["Hello there.", "How are you today?", "I am well, thank you!"]


@pytest.fixture(scope="module")
def codec():
    return quiet_codec()


def ws_url(server, voice="tara", **query):
    return server.url.replace("http", "ws") + f"/v1/text-to-speech/{voice}/stream-input" + \
        ("?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else "")


async def receive_json(ws, timeout=60):
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


def test_text_in_pieces_is_spoken_sentence_by_sentence_before_the_text_ends(codec):
    from websockets.asyncio.client import connect

    codes = [random_codes(codec.config, n, seed=40 + k) for k, n in enumerate((5, 4, 6))]
    with serving(codec) as (server, lm, state):
        for sentence, c in zip(SENTENCES, codes):
            lm.script(sentence, c)

        async def talk():
            audio, messages = [], []
            async with connect(ws_url(server, output_format="pcm_24000")) as ws:
                await ws.send(json.dumps({"text": " ", "voice_settings": {"stability": 0.5},
                                          "generation_config": {"chunk_length_schedule": [50]}}))
                for piece in ("Hello ", "there. How are", " you to"):
                    await ws.send(json.dumps({"text": piece, "try_trigger_generation": True}))
                first = await receive_json(ws)  # audio of the first sentence while the text goes on
                audio.append(first["audio"])
                await ws.send(json.dumps({"text": "day? I am well, thank you!"}))
                await ws.send(json.dumps({"text": "not json"})[:-1])
                await ws.send(json.dumps({"text": ""}))
                while True:
                    message = await receive_json(ws)
                    messages.append(message)
                    if message.get("isFinal"):
                        break
                    if message.get("audio"):
                        audio.append(message["audio"])
                with pytest.raises(Exception):
                    await ws.recv()
                return first, audio, messages, ws.close_code
        first, audio, messages, code = asyncio.run(talk())
    prompts = [p.split(": ", 1)[1].split("<|eot_id|>")[0] for p in lm.prompts]
    assert prompts == SENTENCES and code == 1000
    assert set(first) == {"audio", "isFinal", "normalizedAlignment", "alignment"} and first["isFinal"] is None
    errors = [m for m in messages if "error" in m]
    assert len(errors) == 1 and errors[0]["error"] == "invalid_message" and "JSON" in errors[0]["message"]
    pcm = np.frombuffer(b"".join(base64.b64decode(a) for a in audio), "<i2").astype(np.float64)
    want = joined_pcm(codec, codes)
    assert pcm.shape == want.shape and np.abs(pcm - want).max() <= 1  # the joins are the decoder's own
    assert state.backend.open_streams == 0


def test_text_stream_refuses_what_it_cannot_serve_and_times_out(codec):
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    c = random_codes(codec.config, 4, seed=50)
    with serving(codec, api_key="sesame") as (server, lm, state):
        lm.script("Quiet now.", c)

        async def closed(url, headers=None, send=()):
            async with connect(url, additional_headers=headers or {}) as ws:
                for message in send:
                    await ws.send(json.dumps(message))
                replies = []
                with pytest.raises(Exception):
                    while True:
                        replies.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
                return ws.close_code, ws.close_reason, replies
        key = {"xi-api-key": "sesame"}
        with pytest.raises(InvalidStatus) as no_key:  # refused at the handshake
            asyncio.run(closed(ws_url(server)))
        voice = asyncio.run(closed(ws_url(server, voice="alloy"), key))
        fmt = asyncio.run(closed(ws_url(server, output_format="wav_9"), key))
        idle = asyncio.run(closed(ws_url(server, output_format="ulaw_8000", inactivity_timeout=1), key,
                                  [{"text": " ", "voice_settings": {"speed": 2.0}}, {"text": "Quiet now. "}]))
    assert no_key.value.response.status_code == 403
    assert voice[0] == 1008 and "voice_id must be one of" in voice[2][0]["message"]
    assert fmt[0] == 1008 and "output_format" in fmt[1]
    code, reason, replies = idle  # the sentence spoken (8 kHz mu-law, twice as fast), then closed for silence
    assert code == 1008 and "inactivity_timeout" in reason and replies[-1]["error"] == "input_timeout_exceeded"
    ulaw = b"".join(base64.b64decode(r["audio"]) for r in replies if r.get("audio"))
    assert len(ulaw) == pytest.approx(4 * 2048 / 3 / 2, abs=150)  # 4 frames at 8 kHz, a byte a sample, at speed 2
    assert state.backend.open_streams == 0


def test_the_elevenlabs_sdk_speaks_through_the_server(codec, tmp_path, monkeypatch):
    """ElevenLabs' own Python SDK (`convert_realtime`, base URL pointed here; it always speaks wss,
    so the server runs TLS with a certificate the test makes and the client trusts). Its WebSocket
    opens with websockets' default 10 s handshake timeout, which a loaded 2-core CI host once
    exceeded: the test gives the handshake 60 s, the SDK otherwise as published."""
    elevenlabs = pytest.importorskip("elevenlabs")
    import functools
    import os

    import elevenlabs.realtime_tts as realtime

    monkeypatch.setattr(realtime, "connect", functools.partial(realtime.connect, open_timeout=60))

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    codes = [random_codes(codec.config, n, seed=60 + k) for k, n in enumerate((4, 5, 3))]
    os.environ["SSL_CERT_FILE"] = str(cert)  # the SDK's default TLS context trusts it
    try:
        with serving(codec, tls={"ssl_certfile": str(cert), "ssl_keyfile": str(key)}, api_key="sesame") as (server, lm, _):
            for sentence, c in zip(SENTENCES, codes):
                lm.script(sentence, c)
            client = elevenlabs.ElevenLabs(api_key="sesame", base_url=server.url)
            chunks = list(client.text_to_speech.convert_realtime(
                voice_id="tara", text=iter(["Hello there. ", "How are you ", "today? I am well, ", "thank you!"]),
                output_format="pcm_24000"))
    finally:
        del os.environ["SSL_CERT_FILE"]
    pcm = np.frombuffer(b"".join(chunks), "<i2").astype(np.float64)
    want = joined_pcm(codec, codes)
    assert pcm.shape == want.shape and np.abs(pcm - want).max() <= 1


@pytest.mark.parametrize("accept", [False, True], ids=["compression declined (default)", "--ws-compression"])
def test_a_clients_offer_of_compression_is_declined_unless_the_server_is_told(codec, accept):
    """permessage-deflate costs a worker ~1 ms of CPU per 9 KB audio message for a quarter of its
    bytes: serve declines the offer that the websockets library and browsers make, unless told."""
    from websockets.asyncio.client import connect

    lm_codes = random_codes(codec.config, 4, seed=60)
    with serving(codec, ws_compression=accept) as (server, lm, state):
        lm.script("Hello there.", lm_codes)

        async def talk():
            audio = []
            async with connect(ws_url(server, output_format="pcm_24000")) as ws:  # offers permessage-deflate
                agreed = ws.response.headers.get("Sec-WebSocket-Extensions")
                await ws.send(json.dumps({"text": " "}))
                await ws.send(json.dumps({"text": "Hello there.", "flush": True}))
                await ws.send(json.dumps({"text": ""}))
                while not (message := await receive_json(ws)).get("isFinal"):
                    if message.get("audio"):
                        audio.append(message["audio"])
            return agreed, audio
        agreed, audio = asyncio.run(talk())
    assert (agreed is not None and "permessage-deflate" in agreed) == accept
    pcm = np.frombuffer(b"".join(base64.b64decode(a) for a in audio), "<i2").astype(np.float64)
    want = joined_pcm(codec, [lm_codes])
    assert pcm.shape == want.shape and np.abs(pcm - want).max() <= 1
