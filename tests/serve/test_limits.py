"""The limits a public endpoint needs, each against a live server: body size, open streams per
key, WebSocket message size and rate, an idle WebSocket, slow headers; every slot comes back."""

import asyncio
import json
import socket
import time

import httpx
import pytest
from helpers import NARROW
from live_server import serving

from snac_fast import FastSNAC
from snac_fast.model.synthetic import synthetic_model


@pytest.fixture(scope="module")
def codec():
    return FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu", fuse=False)


def ws(server, path="/v1/audio/stream", headers=None):
    from websockets.asyncio.client import connect

    return connect(server.url.replace("http", "ws") + path, additional_headers=headers or {}, max_size=None)


async def closed_with(connection, send=(), wait_s=10.0):
    """Send ``send``, then read until the server closes: (code, reason)."""
    from websockets.exceptions import ConnectionClosed

    async with connection as socket_:
        try:
            for message in send:
                await socket_.send(message)
            while True:
                await asyncio.wait_for(socket_.recv(), wait_s)
        except ConnectionClosed as e:
            return e.rcvd.code if e.rcvd else None, e.rcvd.reason if e.rcvd else ""
    return socket_.close_code, socket_.close_reason


def test_body_size_and_streams_per_key(codec):
    with serving(codec, api_key="alpha,beta", max_streams_per_key=1, max_body_bytes=10_000) as (server, lm, state):
        lm.pace, lm.frames = 1.0, 12  # 1 s of audio at real time: the first stream stays open
        a, b = {"Authorization": "Bearer alpha"}, {"xi-api-key": "beta"}
        big = httpx.post(server.url + "/v1/audio/speech", headers=a, content=b'{"input": "' + b"x" * 20_000 + b'"}')

        def chunked():
            yield b'{"input": "'
            for _ in range(30):
                yield b"y" * 1000
            yield b'"}'
        streamed = httpx.post(server.url + "/v1/audio/speech", headers=a, content=chunked())

        async def three():
            async with httpx.AsyncClient(timeout=60) as client:
                first = asyncio.create_task(client.post(server.url + "/v1/audio/speech", headers=a,
                                                        json={"input": "one", "response_format": "pcm"}))
                await asyncio.sleep(0.6)  # the first holds key alpha's one stream
                second = await client.post(server.url + "/v1/audio/speech", headers=a, json={"input": "two"})
                other = await client.post(server.url + "/v1/audio/speech", headers=b, json={"input": "three"})
                return await first, second, other
        first, second, other = asyncio.run(three())
        again = httpx.post(server.url + "/v1/audio/speech", headers=a, json={"input": "four"}, timeout=60)
        time.sleep(0.3)
        health = httpx.get(server.url + "/health", headers=a).json()  # the details need the key
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert streamed.status_code == 413  # no Content-Length: counted as it came
    assert first.status_code == 200 and other.status_code == 200 and again.status_code == 200
    assert second.status_code == 429 and second.json()["error"]["code"] == "too_many_streams"
    assert second.headers["retry-after"] == "1" and "--max-streams-per-key 1" in second.json()["error"]["message"]
    assert health["open_streams"] == 0 and state.owners.open == {}


def test_websocket_size_rate_and_idle_limits(codec):
    with serving(codec, max_ws_message_bytes=2000, max_ws_messages_per_s=5, ws_idle_timeout_s=0.5) as (server, _, state):
        too_big = asyncio.run(closed_with(ws(server), [json.dumps({"ids": [128266] * 400})]))
        too_many = asyncio.run(closed_with(ws(server), [json.dumps({"ids": []})] * 30))
        started = time.monotonic()
        idle = asyncio.run(closed_with(ws(server)))
        idle_s = time.monotonic() - started
        text_too_many = asyncio.run(closed_with(ws(server, "/v1/text-to-speech/tara/stream-input?output_format=pcm_24000"),
                                                [json.dumps({"text": " "})] * 30))
        time.sleep(0.3)
        health = httpx.get(server.url + "/health").json()
    assert too_big[0] == 1009  # uvicorn's ws_max_size
    assert too_many[0] == 1008 and "max-ws-messages-per-s" in too_many[1]
    assert idle[0] == 1008 and "nothing sent for 0.5 s" in idle[1] and idle_s < 5
    assert text_too_many[0] == 1008
    assert health["open_streams"] == 0 and health["slots_in_use"] == 0 and state.owners.open == {}


def test_a_client_that_trickles_its_headers_is_dropped(codec):
    with serving(codec, header_timeout_s=0.5) as (server, _, _):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            started = time.monotonic()
            closed = slow.recv(100) == b""  # the server closes it: no answer
            took = time.monotonic() - started
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as quick:
            quick.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = quick.recv(100)
    assert closed and 0.3 < took < 5
    assert answer.startswith(b"HTTP/1.1 200")
