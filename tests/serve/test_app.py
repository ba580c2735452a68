"""`snac-fast serve` (snac_fast.serve: the app, its routes, the backends, the LM client) over real HTTP and WebSocket connections on the loopback:
uvicorn serves the app and a fake OpenAI-compatible LM (Starlette) that streams Orpheus tokens,
cut at random places, with malformed tokens and early stops on request. Every response's audio is
checked against the offline decode of the codes the LM sent (float32: >= 100 dB)."""

import asyncio
import base64
import contextlib
import json
import os
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from helpers import NARROW, random_codes
from live_server import LiveServer, serving

from snac_fast import FastSNAC
from snac_fast.metrics import snr_db
from snac_fast.model.synthetic import synthetic_model
from snac_fast.orpheus import CUSTOM_TOKEN_ID, ORPHEUS
from snac_fast.runtime.process_name import ENGINE_NAME, WORKER_NAME
from snac_fast.serve import ServeSettings, create_app
from snac_fast.serve.lm.client import LMClient, LMOutputError
from snac_fast.serve.lm.presets import PRESETS
from snac_fast.serve.lm.fake import FakeLM

RATE = 24000


@pytest.fixture(scope="module")
def codec():
    return FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu", fuse=False)


def slots_freed(state, timeout: float = 10.0) -> bool:
    """Whether every engine slot came back within ``timeout`` s (a release runs with the engine calls)."""
    deadline = time.monotonic() + timeout
    while state.backend.engine.open_streams and time.monotonic() < deadline:
        time.sleep(0.02)
    return state.backend.engine.open_streams == 0


def expected(codec, codes, seed):
    return codec.decode(codes, seed=seed)[0, 0].float()


def lm_client(**options) -> LMClient:
    """The LM client a server of these settings makes."""
    settings = ServeSettings.of(**options)
    return LMClient(settings.lm, settings.layout, settings.engine.max_streams)


def _engine_checkpoint(tmp_path) -> tuple[str, dict]:
    """A seeded 24 kHz checkpoint (narrow) for an engine process, and its model options (CPU)."""
    from snac_fast.model.synthetic import make_checkpoint

    return str(make_checkpoint(tmp_path / "model", "snac_24khz", **NARROW)), {"fuse": False, "accelerate_encoder": False}


async def speak(url, text, seed, **fields):
    async with httpx.AsyncClient(timeout=120) as client:
        body = {"model": "orpheus", "input": text, "voice": "tara", "seed": seed, "response_format": "pcm", **fields}
        async with client.stream("POST", url + "/v1/audio/speech", json=body) as response:
            data = b"".join([chunk async for chunk in response.aiter_bytes()])
            return response.status_code, response.headers, data


@pytest.mark.heavy
def test_speech_streams_exact_audio_to_32_concurrent_clients(codec):
    codes = {f"line {i}": random_codes(codec.config, 5 + i % 2, seed=500 + i) for i in range(32)}
    with serving(codec, max_streams=32, max_batch=32) as (server, lm, state):
        for text, c in codes.items():
            lm.script(text, c)

        async def main():
            return await asyncio.gather(*(speak(server.url, text, i, response_format="pcm", sample_format="f32")
                                          for i, text in enumerate(codes)))
        results = asyncio.run(main())
        assert lm.prompts[0] == PRESETS["orpheus"].render("tara", lm.prompts[0].split(": ", 1)[1].split("<|eot_id|>")[0])
        assert lm.prompts[0].startswith("<custom_token_3><|begin_of_text|>tara: line ")
        assert slots_freed(state) and state.backend.batcher.batches < sum(5 + i % 2 for i in range(32))
    for i, (text, c) in enumerate(codes.items()):
        status, headers, data = results[i]
        assert status == 200, (text, status, data[:400])
        assert headers["content-type"] == "audio/pcm" and headers["x-sample-rate"] == str(RATE)
        got = torch.from_numpy(np.frombuffer(data, "<f4").copy())
        want = expected(codec, c, i)
        assert got.shape == want.shape, text
        assert snr_db(want, got) >= 100, text


def test_speech_wav_int16_sse_and_early_stop(codec):
    c = random_codes(codec.config, 7, seed=600)
    with serving(codec) as (server, lm, state):
        lm.script("wav", c)
        lm.script("cut", c, stop_early=True)
        lm.script("sse", c)

        async def main():
            return await asyncio.gather(speak(server.url, "wav", 1, response_format="wav"),
                                        speak(server.url, "cut", 2, sample_format="f32"),
                                        speak(server.url, "sse", 3, stream_format="sse", sample_format="f32"))
        (s1, h1, wav), (s2, _, cut), (s3, h3, sse) = asyncio.run(main())
    assert s1 == 200 and h1["content-type"] == "audio/wav" and wav[:4] == b"RIFF" and wav[8:16] == b"WAVEfmt "
    assert int.from_bytes(wav[24:28], "little") == RATE and int.from_bytes(wav[34:36], "little") == 16
    assert wav[36:40] == b"data"  # the plain 44-byte header that clients which skip 44 bytes expect
    # the way to the first audio, step by step, in Server-Timing (ms): each step >= 0, within the total
    timing = {k: float(v) for k, v in (part.strip().split(";dur=") for part in h1["server-timing"].split(","))}
    marks = {name: timing.pop(name) for name in ("lm_asked_at", "lm_sent_at", "frames_ready_at")}
    assert set(timing) == {"setup", "lm_connect", "lm_send", "lm_first", "lm", "engine", "encode", "total"}, timing
    assert min(timing.values()) >= 0 and timing["lm_first"] <= timing["lm"]
    # the LM request's connection taken or made, then its headers written, before its first ids came
    assert timing["lm_connect"] <= timing["lm_send"] <= timing["lm_first"]
    assert abs(marks["lm_sent_at"] - marks["lm_asked_at"] - timing["lm_send"]) <= 0.02
    assert timing["setup"] + timing["lm"] + timing["engine"] + timing["encode"] <= timing["total"] + 0.05
    # the clock marks: the host's monotonic clock (ms), the LM's span between them, before now
    assert abs(marks["frames_ready_at"] - marks["lm_asked_at"] - timing["lm"]) <= 0.02
    assert 0 < marks["frames_ready_at"] < time.monotonic() * 1e3
    pcm = np.frombuffer(wav[44:], "<i2").astype(np.float64)
    want = expected(codec, c, 1).double().numpy()
    assert pcm.shape == want.shape and np.abs(pcm - np.rint(want * 32767)).max() <= 1
    # an LM cut off mid-frame: the whole frames' audio, exactly
    whole = [level[:, :6 * level.shape[1] // 7] for level in c]
    got = torch.from_numpy(np.frombuffer(cut, "<f4").copy())
    assert s2 == 200 and snr_db(expected(codec, whole, 2), got) >= 100
    events = [json.loads(line[6:]) for line in sse.decode().split("\n\n") if line.startswith("data: ")]
    assert s3 == 200 and h3["content-type"].startswith("text/event-stream")
    assert [e["type"] for e in events[-1:]] == ["speech.audio.done"]
    audio = np.concatenate([np.frombuffer(base64.b64decode(e["audio"]), "<f4") for e in events[:-1]])
    assert snr_db(expected(codec, c, 3), torch.from_numpy(audio.copy())) >= 100


def test_malformed_tokens_give_clear_errors_and_free_the_slot(codec):
    c = random_codes(codec.config, 8, seed=700)
    with serving(codec) as (server, lm, state):
        lm.script("early", c, bad_at=3)  # before the first audio: a 502 with the reason
        lm.script("late", c, bad_at=45)  # after it: an error event (sse)

        async def main():
            return await asyncio.gather(speak(server.url, "early", 1), speak(server.url, "late", 2, stream_format="sse"))
        (s1, _, early), (s2, _, late) = asyncio.run(main())
        assert s1 == 502
        assert "not audio" in json.loads(early)["error"]["message"] and "token 3" in json.loads(early)["error"]["message"]
        events = [json.loads(line[6:]) for line in late.decode().split("\n\n") if line.startswith("data: ")]
        assert s2 == 200 and events[-1]["type"] == "error" and "token 45" in events[-1]["error"]["message"]
        assert events[0]["type"] == "speech.audio.delta"
        assert slots_freed(state)
        metrics = httpx.get(server.url + "/metrics").text
        assert 'snac_fast_requests_total{endpoint="speech",outcome="lm_error"} 2.0' in metrics


def test_bad_requests_backpressure_and_disconnects(codec):
    c = random_codes(codec.config, 40, seed=800)
    with serving(codec, max_streams=2) as (server, lm, state):
        lm.script("slow", c, delay=0.05)
        lm.script("quick", [level[:, :5 * level.shape[1] // 40] for level in c])
        for body, message in [({"voice": "tara"}, "'input'"), ({"input": "x", "response_format": "ogg_vorbis"}, "response_format"),
                              ({"input": "x", "seed": "a"}, "'seed'")]:
            r = httpx.post(server.url + "/v1/audio/speech", json=body)
            assert r.status_code == 400 and message in r.json()["error"]["message"]

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                streams = [client.stream("POST", server.url + "/v1/audio/speech", json={"input": "slow"}) for _ in range(2)]
                first = await streams[0].__aenter__()
                second = await streams[1].__aenter__()
                assert first.status_code == second.status_code == 200
                busy = await client.post(server.url + "/v1/audio/speech", json={"input": "slow"})
                assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
                health = (await client.get(server.url + "/health")).json()
                assert health["open_streams"] == 2 and health["max_streams"] == 2
                async for _ in first.aiter_bytes():
                    break
                await streams[0].__aexit__(None, None, None)  # the client goes away mid-stream
                await streams[1].__aexit__(None, None, None)
                for _ in range(100):
                    if (await client.get(server.url + "/health")).json()["slots_in_use"] == 0:
                        break
                    await asyncio.sleep(0.05)
                assert state.backend.engine.open_streams == 0  # both slots came back at once, not after the LM finished
                again = await client.post(server.url + "/v1/audio/speech", json={"input": "quick", "seed": 1})
                assert again.status_code == 200
        asyncio.run(main())


@pytest.mark.parametrize("engine_thread, max_wait_ms", [(False, 0.0), (True, 3.0)])
def test_websocket_ids_in_pcm_out(codec, engine_thread, max_wait_ms):
    """Also the server's batcher both ways: engine calls on uvicorn's loop (default), or a thread
    (with --max-wait-ms)."""
    from websockets.asyncio.client import connect

    c = random_codes(codec.config, 9, seed=900)
    ids = ORPHEUS.codes_to_ids(c).tolist()
    with serving(codec, engine_calls="thread" if engine_thread else "loop", max_wait_ms=max_wait_ms) as (server, lm, state):
        assert state.backend.batcher.engine_thread == engine_thread and state.backend.batcher.intake.max_wait == max_wait_ms / 1e3
        async def main():
            ws_url = server.url.replace("http", "ws") + "/v1/audio/stream?seed=4&sample_format=f32"
            pieces, errors = [], []
            async with connect(ws_url) as ws:
                for at, n in [(0, 5), (5, 16), (21, 7)]:  # JSON, cut inside frames
                    await ws.send(json.dumps({"ids": ids[at:at + n]}))
                await ws.send(json.dumps({"ids": [1, 2, 3]}))  # not audio ids: an error event, the stream goes on
                await ws.send(np.asarray(ids[28:], "<i4").tobytes())  # binary int32
                await ws.send(json.dumps({"end": True}))
                while True:  # audio as it becomes final, then "done"
                    message = await ws.recv()
                    if isinstance(message, bytes):
                        pieces.append(message)
                    elif json.loads(message)["type"] == "error":
                        errors.append(json.loads(message))
                    else:
                        assert json.loads(message) == {"type": "done"}
                        break
            async with connect(ws_url) as ws:  # closed mid-stream: the slot comes back
                await ws.send(json.dumps({"ids": ids[:35]}))
                await ws.recv()
            return pieces, errors
        pieces, errors = asyncio.run(main())
        assert slots_freed(state)
    assert errors[0]["type"] == "error" and "not a code of frame slot" in errors[0]["message"]
    got = torch.from_numpy(np.frombuffer(b"".join(p for p in pieces if isinstance(p, bytes)), "<f4").copy())
    assert snr_db(expected(codec, c, 4), got) >= 100


def test_graceful_shutdown_finishes_streams_in_flight(codec):
    c = random_codes(codec.config, 8, seed=1000)
    lm = FakeLM(split_tokens=True)
    lm.script("long", c, delay=0.02)
    with LiveServer(lm.app) as lm_server:
        app = create_app(codec, ServeSettings.of(lm_url=lm_server.url + "/v1"))
        live = LiveServer(app).__enter__()
        result = {}

        def client():
            with httpx.stream("POST", live.url + "/v1/audio/speech", json={"input": "long", "seed": 5,
                                                                           "response_format": "pcm", "sample_format": "f32"}, timeout=60) as r:
                result["status"] = r.status_code
                result["data"] = b"".join(r.iter_bytes())
        t = threading.Thread(target=client)
        t.start()
        while not app.state.server.backend.batcher.open_streams:
            time.sleep(0.01)
        live.__exit__(None, None, None)  # as on SIGTERM: stop accepting, finish what is in flight
        t.join(60)
    assert result["status"] == 200
    got = torch.from_numpy(np.frombuffer(result["data"], "<f4").copy())
    assert snr_db(expected(codec, c, 5), got) >= 100


def test_websocket_stream_with_a_lookahead_starts_sooner(codec):
    """--lookahead 2048: the first audio comes after the second frame (not the exact stream's
    fourth), one frame's worth, and the stream's audio is the approximate engine's."""
    from websockets.asyncio.client import connect

    c = random_codes(codec.config, 6, seed=901)
    ids = ORPHEUS.codes_to_ids(c).tolist()
    with serving(codec, lookahead=2048) as (server, lm, state):
        assert state.backend.engine.first_audio_frames == 2

        async def main():
            ws_url = server.url.replace("http", "ws") + "/v1/audio/stream?seed=4&sample_format=f32"
            async with connect(ws_url) as ws:
                await ws.send(json.dumps({"ids": ids[:7]}))
                await ws.send(json.dumps({"ids": ids[7:14]}))
                first = await asyncio.wait_for(ws.recv(), 60)
                for at in range(14, len(ids), 7):
                    await ws.send(json.dumps({"ids": ids[at:at + 7]}))
                await ws.send(json.dumps({"end": True}))
                rest = []
                while not isinstance(message := await ws.recv(), str):
                    rest.append(message)
            return first, rest
        first, rest = asyncio.run(main())
        assert slots_freed(state)
    assert isinstance(first, bytes) and len(first) == 2048 * 4
    got = torch.from_numpy(np.frombuffer(first + b"".join(rest), "<f4").copy())
    assert got.shape == (6 * 2048,) and snr_db(expected(codec, c, 4), got) > 15


def test_serve_cli_refuses_bad_arguments(capsys):
    from snac_fast.cli import main

    assert main(["serve", "--max-streams", "0"]) == 2
    assert "--max-streams" in capsys.readouterr().err
    assert main(["serve", "--lookahead", "soon"]) == 2
    assert "--lookahead must be" in capsys.readouterr().err
    assert main(["serve", "--lm-url", "localhost:8000"]) == 2
    assert "--lm-url must be an http(s) URL" in capsys.readouterr().err
    assert main(["serve", "--max-wait-ms", "-1"]) == 2
    assert "--max-wait-ms must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: one flag for who runs the engine's calls, of three values
        main(["serve", "--engine-calls", "sometimes"])
    assert "--engine-calls: invalid choice" in capsys.readouterr().err
    assert main(["serve", "--cpu-threads", "-1"]) == 2
    assert "--cpu-threads must be >= 0" in capsys.readouterr().err


def test_cpu_workers_share_the_cores(monkeypatch):
    """serve --device cpu: each worker's engine gets the cores over the workers (at least one), or
    --cpu-threads; the engine it makes is the codec's shared one."""
    from snac_fast.serve.engine.process import ready_engine

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert ServeSettings.of(workers=4).threads_per_worker() == 4
    assert ServeSettings.of(workers=32).threads_per_worker() == 1
    assert ServeSettings.of(workers=4, cpu_threads=3).threads_per_worker() == 3
    codec = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu")
    before = torch.get_num_threads()
    try:
        engine, _ = ready_engine(codec, ServeSettings.of(device="cpu", max_streams=3).engine, 1)
        assert torch.get_num_threads() == 1 and engine is codec.shared_stream_engine()
        assert engine.max_streams == 3 and engine.layered is not None
    finally:
        torch.set_num_threads(before)


def test_serve_cli_hands_the_engine_process_its_form_and_wait(monkeypatch):
    """`serve --shared-engine --engine-calls loop --max-wait-ms 4`: the engine process is started
    on one event loop with the wait, and every worker's settings carry it."""

    from snac_fast.cli import main
    from snac_fast.serve import run
    from snac_fast.serve.engine import process as engine_process
    from snac_fast.serve.run import CLAIMS_VARIABLE, ENGINE_VARIABLE, SETTINGS_VARIABLE

    started, ran = [], []

    class Engine:
        address, info = "/tmp/nowhere.sock", {}

        def __init__(self, settings, **options):
            started.append(settings)

        def wait(self):  # the watch thread's: an engine process that never exits
            threading.Event().wait()

        def close(self):
            pass
    monkeypatch.setattr(engine_process, "EngineProcess", Engine)
    monkeypatch.setattr(run, "run_workers", lambda *a, **k: ran.append((json.loads(os.environ[SETTINGS_VARIABLE]),
                                                                         json.loads(os.environ[ENGINE_VARIABLE]))))
    for name in (SETTINGS_VARIABLE, ENGINE_VARIABLE, CLAIMS_VARIABLE):  # serve() sets them: restored after the test
        monkeypatch.setenv(name, "")
    assert main(["serve", "--shared-engine", "--engine-calls", "loop", "--max-wait-ms", "4", "--workers", "2"]) == 0
    assert started[0].engine_calls == "loop" and started[0].max_wait_ms == 4.0
    assert started[0].calls_on_loop(engine_process=True)
    settings, engine = ran[0]
    assert settings["engine"]["max_wait_ms"] == 4.0 and settings["http"]["workers"] == 2
    assert engine["address"] == Engine.address
    # the engine process is handed its settings alone; the earlier flag still means the same
    assert type(started[0]).__name__ == "EngineSettings"
    assert main(["serve", "--shared-engine", "--engine-event-loop", "--workers", "2"]) == 0
    assert started[1].engine_calls == "loop"


def test_lm_client_streams_as_many_requests_at_once_as_the_server_has_streams():
    """Every stream holds its own LM connection: 150 streams at once reach the LM together (a pool of
    100 connections, httpx's and aiohttp's default, queued the rest behind whole answers)."""
    lm = FakeLM(pace=0.05, frames=3)  # slow answers: ~0.24 s a token, all held open together
    streams = 150
    with LiveServer(lm.app) as lm_server:
        async def run() -> int:
            client = lm_client(lm_url=lm_server.url + "/v1", max_streams=streams)
            release = asyncio.Event()

            async def one(i: int) -> None:
                async for _ in client.ids(f"held {i}", "tara", "orpheus"):
                    await release.wait()
                    break
            tasks = [asyncio.create_task(one(i)) for i in range(streams)]
            deadline = time.monotonic() + 20
            while len(lm.prompts) < streams and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            reached = len(lm.prompts)
            release.set()
            await asyncio.gather(*tasks)
            await client.aclose()
            return reached
        assert asyncio.run(run()) == streams


def test_lm_client_hands_a_late_reader_every_id_that_arrived_in_one_list():
    """A stream whose consumer was busy (its last push, its encoder) gets all the ids that arrived
    meanwhile at once, so it pushes all its whole frames in one call: read one event at a time, a
    server's mp3 streams pushed one frame a round and fell seconds behind the LM. Tokens cut
    between events, the order, and the end of speech mid-burst (nothing after it) hold."""
    tokens = list(range(10, 45))  # 5 frames of 7
    text = "".join(f"<custom_token_{t}>" for t in tokens)
    pieces = [text[i:i + 9] for i in range(0, len(text), 9)]  # tokens cut across events
    events = b"".join(b'data: %s\n\n' % json.dumps({"choices": [{"text": p}]}).encode() for p in pieces)
    late = b'data: {"choices": [{"text": "<custom_token_50><custom_token_2><custom_token_51>"}]}\n\n'
    first = b'data: {"choices": [{"text": "<custom_token_60>"}]}\n\n'
    sent = asyncio.Event()

    async def run() -> list:
        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            for part in [first, events, late]:
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
                await sent.wait()  # the next part once the reader has fallen behind
                sent.clear()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = lm_client(lm_url=f"http://127.0.0.1:{port}/v1")
        got = []
        async for ids in client.ids("busy", "tara", None):
            got.append(ids)
            sent.set()
            await asyncio.sleep(0.2)  # busy: the next part has arrived by the time it reads again
        await client.aclose()
        server.close()
        return got

    got = asyncio.run(run())
    # custom_token_2 is the end of speech (2 ends it): what followed it is dropped
    assert got == [[CUSTOM_TOKEN_ID + 60], [CUSTOM_TOKEN_ID + t for t in tokens], [CUSTOM_TOKEN_ID + 50]]


def test_lm_client_retries_a_pooled_connection_the_lm_closed_but_not_a_cut_answer():
    """An LM that closes a kept-alive connection as the next request arrives on it (uvicorn's 5 s
    keep-alive against a busy loop): the request goes again on a new connection, once. An answer
    cut after it began is not asked again: its ids were already given out."""
    event = b'data: {"choices": [{"text": "<custom_token_20>"}]}\n\n'
    connections, requests, answered = [], [], []

    async def run() -> list:
        async def handle(reader, writer):
            connections.append(writer)
            served = 0
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                prompt = json.loads(await reader.readexactly(length))["prompt"]
                requests.append(prompt)
                if served:  # the second request on a connection: closed unanswered
                    writer.close()
                    return
                served += 1
                answered.append(prompt)
                cut = "cut" in prompt
                body = event + (b"" if cut else b"data: [DONE]\n\n")
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n"
                             % (len(body) + 100 * cut) + body)  # cut: fewer bytes than announced, then closed
                await writer.drain()
                if cut:
                    writer.close()
                    return

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = lm_client(lm_url=f"http://127.0.0.1:{port}/v1")
        got = []
        for i in range(3):
            got.append([ids async for ids in client.ids(f"line {i}", "tara", None)])
        with pytest.raises(LMOutputError, match="failed"):
            [ids async for ids in client.ids("cut", "tara", None)]
        await client.aclose()
        server.close()
        return got

    assert asyncio.run(run()) == [[[CUSTOM_TOKEN_ID + 20]]] * 3
    # every request after the first went first on a kept-alive connection (closed unanswered), then
    # on a new one; the cut answer was not asked for again
    assert len(requests) == 7 and len(connections) == 4
    assert len(answered) == 4 and sum("cut" in p for p in answered) == 1


@pytest.mark.parametrize("lm_status, retry_after, status, kind, client_retry_after", [
    (503, "7", 503, "lm_busy", "7"), (429, None, 503, "lm_busy", "1"), (500, None, 502, "lm_output_error", None)])
def test_an_overloaded_lm_is_a_503_to_retry_and_a_failing_one_a_502(codec, lm_status, retry_after, status, kind,
                                                                    client_retry_after):
    """The LM answers 429 or 503 (vLLM's queue full): the speech request gets 503 with the LM's
    Retry-After (1 s without one), so clients retry as for a full engine; any other error is a 502."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def completions(request):
        headers = {"Retry-After": retry_after} if retry_after else {}
        return PlainTextResponse("queue full", status_code=lm_status, headers=headers)

    lm = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    with LiveServer(lm) as lm_server:
        app = create_app(codec, ServeSettings.of(lm_url=lm_server.url + "/v1"))
        with LiveServer(app) as server:
            r = httpx.post(server.url + "/v1/audio/speech", json={"input": "hello"}, timeout=60)
            assert r.status_code == status and r.json()["error"]["type"] == kind
            assert f"answered {lm_status}: queue full" in r.json()["error"]["message"]
            assert r.headers.get("retry-after") == client_retry_after
            assert slots_freed(app.state.server)


def test_an_engine_that_fails_every_call_turns_health_to_503_until_one_runs(codec, monkeypatch):
    """Every engine call failing (as after a sticky CUDA error): each speech request gets a 500 JSON
    error naming the failure, and after FAILING_CALLS of them in a row /health answers 503
    "engine_failing" with it, so an orchestrator restarts the server; one call that runs clears it."""
    from snac_fast.serve.engine.backend import FAILING_CALLS

    c = random_codes(codec.config, 5, seed=620)
    with serving(codec) as (server, lm, state):
        lm.script("hello", c)
        real = state.backend.engine.step_rows

        def broken(*args, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        monkeypatch.setattr(state.backend.engine, "step_rows", broken)
        for i in range(FAILING_CALLS):
            r = httpx.post(server.url + "/v1/audio/speech", json={"input": "hello", "seed": i}, timeout=60)
            assert r.status_code == 500 and r.json()["error"]["type"] == "engine_error", r.text
            assert "illegal memory access" in r.json()["error"]["message"]
            health = httpx.get(server.url + "/health")
            assert health.status_code == (503 if i == FAILING_CALLS - 1 else 200), (i, health.text)
        assert health.json()["status"] == "engine_failing" and "illegal memory access" in health.json()["error"]
        assert f"snac_fast_failed_steps_in_a_row {FAILING_CALLS:.1f}" in httpx.get(server.url + "/metrics").text
        monkeypatch.setattr(state.backend.engine, "step_rows", real)
        r = httpx.post(server.url + "/v1/audio/speech", json={"input": "hello", "seed": 1, "response_format": "pcm", "sample_format": "f32"},
                       timeout=60)
        assert r.status_code == 200 and httpx.get(server.url + "/health").json()["status"] == "ok"
        # a call failing after the first audio: an SSE stream ends with an error event naming it
        audio_out = []

        def fails_after_audio(*args, **kwargs):
            if audio_out:
                raise RuntimeError("CUDA error: out of memory")
            audio, offsets = real(*args, **kwargs)
            if offsets[-1]:
                audio_out.append(1)
            return audio, offsets
        monkeypatch.setattr(state.backend.engine, "step_rows", fails_after_audio)
        lm.script("late", random_codes(codec.config, 40, seed=621), delay=0.05)  # a push at a time
        status, _, body = asyncio.run(speak(server.url, "late", 2, stream_format="sse"))
        events = [json.loads(line[6:]) for line in body.decode().split("\n\n") if line.startswith("data: ")]
        assert status == 200 and events[0]["type"] == "speech.audio.delta"
        assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "engine_error"
        assert "out of memory" in events[-1]["error"]["message"]
        assert slots_freed(state)
    got = torch.from_numpy(np.frombuffer(r.content, "<f4").copy())
    assert snr_db(expected(codec, c, 1), got) >= 100


def test_a_stream_idled_out_while_the_lm_stalls_says_so(codec):
    """An LM that pauses longer than the idle timeout between tokens: the stream is released, and
    the request's error says that, not that the LM sent a token that is not audio."""
    with serving(codec, idle_timeout_s=0.4) as (server, lm, state):
        lm.script("slow", random_codes(codec.config, 5, seed=630), delay=1.2)
        status, _, body = asyncio.run(speak(server.url, "slow", 1))
        assert slots_freed(state)
    assert status == 502, body
    message = json.loads(body)["error"]["message"]
    assert "stream ended while the language model was still sending" in message and "idle for over 0.4 s" in message


def test_an_unreachable_lm_is_a_clear_502(codec):
    """An LM that refuses connections: the request gets a 502 naming the LM's URL, not a 500 page,
    and the stream's slot is freed."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(codec, ServeSettings.of(lm_url=f"http://127.0.0.1:{port}/v1"))
    with LiveServer(app) as server:
        r = httpx.post(server.url + "/v1/audio/speech", json={"input": "hello"}, timeout=60)
        assert r.status_code == 502
        message = r.json()["error"]["message"]
        assert f"127.0.0.1:{port}" in message and "failed" in message
        assert slots_freed(app.state.server)


def test_fake_lm_paces_its_tokens_and_records_first_frames():
    """The benchmark's LM: random codes for any prompt at the set pace; /stats says when the token
    completing the first decodable frames left (the start of the server's time to first audio)."""
    lm = FakeLM(pace=20.0, frames=10)  # 10 frames at 20x real time: ~43 ms
    with LiveServer(lm.app) as server:
        start = time.monotonic()
        with httpx.stream("POST", server.url + "/v1/completions",
                          json={"prompt": PRESETS["orpheus"].render("tara", "hi"), "stream": True}) as r:
            text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                           if line.startswith("data: {"))
        took = time.monotonic() - start
        first = httpx.get(server.url + "/stats").json()["first_sent"]["hi"]
    tokens = [int(n) for n in text.replace(">", " ").replace("<custom_token_", " ").split()]
    assert len(tokens) == 10 * 7 + 2 and tokens[-2:] == [2, 6]  # ten frames, then end of speech and of AI
    ORPHEUS.framer().push_row([128256 + n for n in tokens[:-2]])  # every id in its slot
    assert 10 * 2048 / 24000 / 20 * 0.9 <= took < 5
    assert start < first < start + took


def test_workers_take_the_hosts_gpus_in_turn(tmp_path, monkeypatch):
    """Without --device, worker k of a multi-GPU host serves on GPU k modulo their count; a device
    given, or one GPU, or none, is left as it is."""
    from snac_fast.serve.run import worker_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [worker_device(None, str(tmp_path)) for _ in range(5)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert worker_device("cuda:1", str(tmp_path)) == "cuda:1" and worker_device(None, None) is None
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert worker_device(None, str(tmp_path / "other")) is None


def test_workers_sharing_one_engine_process_get_exact_audio(tmp_path):
    """`snac-fast serve --shared-engine`: the app of a worker with no model of its own feeds an engine
    process (CPU here). Two such apps (two workers) at once: four speech requests and a WebSocket
    stream, every answer equal to the offline decode; /health and /metrics speak for the engine."""
    from websockets.asyncio.client import connect

    from snac_fast.serve import EngineProcess

    checkpoint, options = _engine_checkpoint(tmp_path)
    codec = FastSNAC.from_pretrained(checkpoint, device="cpu", dtype=torch.float32, **options)
    codes = {f"shared {i}": random_codes(codec.config, 5 + i % 2, seed=700 + i) for i in range(4)}
    ws_codes = random_codes(codec.config, 6, seed=750)
    with EngineProcess(ServeSettings.of(model=checkpoint, device="cpu", max_streams=8, max_batch=4), output="float32",
                       model_options=options) as engine:
        lm = FakeLM(split_tokens=True)
        for text, c in codes.items():
            lm.script(text, c)
        with LiveServer(lm.app) as lm_server:
            config = dict(lm_url=lm_server.url + "/v1", lm_model="orpheus", max_streams=8)
            apps = [create_app(None, ServeSettings.of(**config), (engine.address, engine.info)) for _ in range(2)]
            with LiveServer(apps[0]) as one, LiveServer(apps[1]) as two:
                async def websocket():
                    pieces = []
                    async with connect(two.url.replace("http", "ws") + "/v1/audio/stream?seed=9&sample_format=f32") as ws:
                        await ws.send(np.asarray(ORPHEUS.codes_to_ids(ws_codes).tolist(), "<i4").tobytes())
                        await ws.send(json.dumps({"end": True}))
                        while isinstance(message := await ws.recv(), bytes):
                            pieces.append(message)
                        assert json.loads(message) == {"type": "done"}
                    return b"".join(pieces)

                async def main():
                    return await asyncio.gather(websocket(), *(speak((one, two)[i % 2].url, text, i, sample_format="f32")
                                                               for i, text in enumerate(codes)))
                streamed, *answers = asyncio.run(main())
                health = httpx.get(one.url + "/health").json()
                metrics = httpx.get(two.url + "/metrics").text
    assert health["max_streams"] == 8 and health["device"] == "cpu" and health["slots_in_use"] == 0
    assert "snac_fast_steps_total" in metrics and "snac_fast_active_streams 0.0" in metrics
    got = torch.from_numpy(np.frombuffer(streamed, "<f4").copy())
    assert snr_db(expected(codec, ws_codes, 9), got) >= 100
    for i, (text, c) in enumerate(codes.items()):
        status, _, data = answers[i]
        assert status == 200, text
        got = torch.from_numpy(np.frombuffer(data, "<f4").copy())
        want = expected(codec, c, i)
        assert got.shape == want.shape and snr_db(want, got) >= 100, text


def test_server_start_up_freezes_its_objects_out_of_the_collectors_reach(codec):
    """A full collection over the start-up objects would stall every stream of a worker: the app's
    start-up (lifespan) freezes what is alive then."""
    import gc

    gc.unfreeze()
    try:
        app = create_app(codec, ServeSettings.of(lm_url="http://127.0.0.1:9/v1"))
        assert gc.get_freeze_count() == 0
        with LiveServer(app):
            frozen = gc.get_freeze_count()
        assert frozen > 10_000  # torch, the model and the app
    finally:
        gc.unfreeze()


def test_start_up_warms_the_decode_path_and_leaves_no_stream_open(codec):
    """Each worker runs one silent stream through its batcher before the first request (the first
    request of a worker paid for first-time work): the engine has decoded, the LM session exists,
    and the warm-up's stream is gone."""
    app = create_app(codec, ServeSettings.of(lm_url="http://127.0.0.1:9/v1"))
    state = app.state.server
    assert state.backend.batcher.batches == 0 and state.lm._session is None
    with LiveServer(app) as server:
        assert state.backend.batcher.batches >= 1 and state.lm._session is not None
        assert slots_freed(state)
        health = httpx.get(server.url + "/health").json()
        assert health["open_streams"] == 0 and health["slots_in_use"] == 0


def test_a_dead_engine_process_fails_each_request_at_once_and_health_says_so(tmp_path):
    """The shared engine process killed under a running worker: a speech request gets a 503 naming
    it at once (not a hang, not a 500), a WebSocket is closed with the reason, /health answers 503
    "engine_lost" and /metrics snac_fast_engine_up 0."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosedError

    from snac_fast.serve import EngineProcess

    checkpoint, options = _engine_checkpoint(tmp_path)
    with EngineProcess(ServeSettings.of(model=checkpoint, device="cpu", max_streams=4, max_batch=4), output="float32",
                       model_options=options) as engine:
        lm = FakeLM(split_tokens=True)
        with LiveServer(lm.app) as lm_server:
            app = create_app(None, ServeSettings.of(lm_url=lm_server.url + "/v1", max_streams=4), (engine.address, engine.info))
            with LiveServer(app) as server:
                assert httpx.get(server.url + "/health").json()["status"] == "ok"
                assert "snac_fast_engine_up 1.0" in httpx.get(server.url + "/metrics").text
                engine.kill()
                start = time.monotonic()
                r = httpx.post(server.url + "/v1/audio/speech", json={"input": "hello"}, timeout=30)
                took = time.monotonic() - start
                health = httpx.get(server.url + "/health", timeout=30)
                metrics = httpx.get(server.url + "/metrics", timeout=30).text

                async def websocket():
                    async with connect(server.url.replace("http", "ws") + "/v1/audio/stream") as ws:
                        with pytest.raises(ConnectionClosedError) as closed:
                            await ws.recv()
                        return closed.value.rcvd
                closed = asyncio.run(websocket())
    assert r.status_code == 503 and r.json()["error"]["type"] == "engine_unavailable", r.text
    assert "engine process went away" in r.json()["error"]["message"] and took < 10
    assert health.status_code == 503 and health.json()["status"] == "engine_lost"
    assert "snac_fast_engine_up 0.0" in metrics
    assert closed.code == 1011 and "engine process went away" in closed.reason


@pytest.mark.heavy
def test_serve_stops_with_status_1_when_its_engine_process_dies(tmp_path):
    """`snac-fast serve --shared-engine`: the engine process killed, the server shuts down by itself
    and exits 1 naming it (a supervisor restarts it), leaving no engine socket behind."""
    import signal
    import subprocess
    import sys

    checkpoint, _ = _engine_checkpoint(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "snac_fast.cli", "serve", "--shared-engine", "--device", "cpu",
                               "--model", checkpoint, "--port", str(port), "--max-streams", "4", "--max-batch", "4"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.2)
        children = []  # the server's child processes: the engine's and multiprocessing's resource tracker
        for entry in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                stat = open(f"/proc/{entry}/stat").read()
                if int(stat.rsplit(")", 1)[1].split()[1]) == server.pid:  # field 4: the parent's pid
                    children.append(int(entry))
        names = {c: open(f"/proc/{c}/comm").read().strip() for c in children}
        engines = [c for c, name in names.items() if name == ENGINE_NAME]  # named for ps and top
        assert len(engines) == 1, names
        os.kill(engines[0], signal.SIGKILL)
        _, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert server.returncode == 1, err[-2000:]
    assert "the engine process exited with code -9" in err and "snac-fast serve: error:" in err


def _listening_sockets(port: int) -> int:
    """How many TCP sockets listen on ``port`` on this host (/proc/net/tcp and tcp6, state 0A)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                count += state == "0A" and int(local.rsplit(":", 1)[1], 16) == port
    return count


def _start_serve(args: list[str], port: int):
    """``snac-fast serve ARGS --port PORT`` as a process, once /health answers 200."""
    import subprocess
    import sys

    server = subprocess.Popen([sys.executable, "-m", "snac_fast.cli", "serve", "--port", str(port), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while True:
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise AssertionError(f"the server did not start: {server.communicate()[1][-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return server
        time.sleep(0.2)


@pytest.mark.heavy
def test_workers_share_a_burst_of_connections_and_the_port_is_theirs(tmp_path):
    """`serve --workers 2`: a burst of 64 connections at once is spread over both workers (uvicorn's
    shared socket gave the first worker to wake nearly all of them), a second server on the same
    port is refused with one line, and SIGTERM stops the workers with status 0."""
    import signal
    import subprocess
    import sys

    checkpoint, _ = _engine_checkpoint(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = _start_serve(["--workers", "2", "--device", "cpu", "--model", checkpoint, "--max-streams", "4",
                           "--max-batch", "4"], port)
    try:
        url = f"http://127.0.0.1:{port}/health"
        deadline = time.monotonic() + 120  # the second worker may still be warming up
        while len({httpx.get(url, timeout=5).json()["pid"] for _ in range(8)}) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)

        async def burst() -> list[int]:
            barrier = asyncio.Event()

            async def one() -> int:
                async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
                    await barrier.wait()
                    return (await client.get(url)).json()["pid"]
            tasks = [asyncio.create_task(one()) for _ in range(64)]
            await asyncio.sleep(0.2)
            barrier.set()
            return await asyncio.gather(*tasks)
        pids = asyncio.run(burst())
        names = [open(f"/proc/{p}/comm").read().strip() for p in set(pids)]  # named for ps and top
        listening = _listening_sockets(port)
        second = subprocess.run([sys.executable, "-m", "snac_fast.cli", "serve", "--port", str(port), "--device", "cpu",
                                 "--model", checkpoint], capture_output=True, text=True, timeout=120)
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    counts = sorted(pids.count(p) for p in set(pids))
    assert names == [WORKER_NAME] * 2
    assert listening == 2  # one listening socket per worker (uvicorn's workers share one)
    assert len(counts) == 2 and counts[0] >= 64 * 0.2, counts  # a hash's spread: 20-80% (binomial tail ~1e-6)
    assert second.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in second.stderr, second.stderr[-1000:]
    assert server.returncode == 0


def test_fake_lm_answers_as_long_as_its_text_and_cuts_a_share_mid_frame():
    lm = FakeLM(chars_per_second=15.0, cut_fraction=0.25)
    texts = [f"sentence number {i} " * (1 + i % 5) for i in range(400)]
    answers = [lm._random_answer(t) for t in texts]
    frames = [len(a["ids"]) // 7 + (not a["end"]) for a in answers]
    assert frames == [max(1, round(len(t) / 15.0 / (2048 / 24000))) for t in texts]
    cut = [not a["end"] for a in answers]
    assert all(len(a["ids"]) % 7 == (4 if c else 0) for a, c in zip(answers, cut))
    assert 0.18 < sum(cut) / len(cut) < 0.32  # the share asked for (binomial, 400 texts)
    assert lm._random_answer(texts[3]) == answers[3]  # the same text, the same answer


def test_fake_lm_injects_failures_stalls_and_junk_into_a_share_of_answers(codec):
    """The soak's faults, each seen by a live server as a client would: a 502 or an SSE stream
    ended by an error event (failure), a 502 naming the silence (stall past --lm-timeout), a 502
    naming the token (junk); and the slots all come back."""
    with serving(codec, lm_timeout_s=1.0) as (server, lm, state):
        lm.faults, lm.stall_seconds, lm.frames = (0.3, 0.3, 0.3), 3.0, 12
        answers = {}
        for k in range(24):
            text = f"fault probe {k}"
            answers[text] = lm._random_answer(text)["fault"]
        got = {}
        for text, fault in answers.items():
            r = httpx.post(server.url + "/v1/audio/speech", json={"input": text, "response_format": "pcm",
                                                                  "stream_format": "sse"}, timeout=30)
            events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: ")] \
                if r.status_code == 200 else []
            got[text] = (r.status_code, events[-1]["type"] if events else r.json()["error"]["type"])
        assert slots_freed(state)
    kinds = set(answers.values())
    assert {"fail", "stall", "junk", None} <= kinds  # each kind drawn (24 texts, shares 0.3 / 0.3 / 0.3 / 0.1)
    for text, fault in answers.items():
        status, last = got[text]
        if fault is None:
            assert (status, last) == (200, "speech.audio.done"), text
        else:  # before the first audio a 502, after it an error event: never a clean end
            assert (status, last) in ((502, "lm_output_error"), (200, "error")), (text, fault, got[text])
