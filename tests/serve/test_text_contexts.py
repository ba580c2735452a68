"""`WS /v1/text-to-speech/{voice}/multi-stream-input` (ElevenLabs' multi-context WebSocket): several
contexts on one connection, each one stream whose audio runs on across its sentences. A client
written from their published protocol, then Pipecat's and LiveKit's ElevenLabs services with their
base URL pointed here."""

import asyncio
import base64
import json
import logging
import time

import numpy as np
import pytest
from helpers import joined_pcm, pipecat_spoken, quiet_codec, random_codes
from live_server import serving


@pytest.fixture(scope="module")
def codec():
    return quiet_codec()


def ws_url(server, voice="tara", **query):
    return server.url.replace("http", "ws") + f"/v1/text-to-speech/{voice}/multi-stream-input" + \
        ("?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else "")


def prompts_of(lm) -> list[str]:
    return [p.split(": ", 1)[1].split("<|eot_id|>")[0] for p in lm.prompts]


def pcm_of(messages, context) -> np.ndarray:
    data = b"".join(base64.b64decode(m["audio"]) for m in messages if m.get("audio") and m["contextId"] == context)
    return np.frombuffer(data, "<i2").astype(np.float64)


def test_contexts_on_one_connection_each_speak_their_sentences_as_one_stream(codec):
    """Three contexts at once: "a" flushed then closed (a turn's end: all of it spoken, then its
    isFinal), "b" written in pieces and spoken across two sentences as one stream, "c" closed
    while it speaks with text never flushed (a barge-in: its audio stops at once)."""
    from websockets.asyncio.client import connect

    script = {"Hello there.": 5, "How are you today?": 4, "I am well, thank you!": 6}
    codes = {text: random_codes(codec.config, n, seed=80 + k) for k, (text, n) in enumerate(script.items())}
    cut = random_codes(codec.config, 40, seed=89)
    with serving(codec, api_key="sesame") as (server, lm, state):
        for text, c in codes.items():
            lm.script(text, c)
        lm.script("Stopped midway.", cut, delay=0.05)  # 40 frames, a chunk of tokens every 50 ms

        async def talk():
            messages = []
            async with connect(ws_url(server, output_format="pcm_24000", model_id="eleven_flash_v2_5"),
                               additional_headers={"xi-api-key": "sesame"}) as ws:
                async def until(seen):  # messages in until one meets ``seen``
                    while not any(seen(m) for m in messages):
                        messages.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))

                async def send(**message):
                    await ws.send(json.dumps(message))
                for context in ("a", "b", "c"):
                    await send(text=" ", context_id=context, voice_settings={"speed": 1})
                await send(text="Hello ", context_id="a")
                await send(text="How are", context_id="b")
                await send(text="Stopped midway. Never said either", context_id="c")
                await send(text="there. ", context_id="a", flush=True)
                await until(lambda m: m.get("contextId") == "a" and m.get("audio"))  # while b's text goes on
                await send(context_id="a", close_context=True)  # a's turn is over: spoken to its end
                await send(text=" you today? ", context_id="b")
                await send(text="", context_id="b")  # keep-alives
                await send(text="")
                await until(lambda m: m.get("contextId") == "c" and m.get("audio"))
                await send(context_id="c", close_context=True)  # c never flushed: a barge-in
                await send(context_id="c", close_context=True)  # c is closed already
                await ws.send("{not json")
                await send(text="I am well, thank you!", context_id="b", flush=True)
                await send(close_socket=True)
                async for raw in ws:
                    messages.append(json.loads(raw))
                return messages, ws.close_code
        messages, code = asyncio.run(talk())
    assert code == 1000
    assert sorted(prompts_of(lm)) == sorted([*script, "Stopped midway."])  # c's unended text never asked
    audio = next(m for m in messages if m.get("audio"))
    assert set(audio) == {"audio", "isFinal", "normalizedAlignment", "alignment", "contextId"}
    errors = [m for m in messages if "error" in m]
    assert [e["error"] for e in errors] == ["invalid_message", "invalid_message"]
    assert errors[0]["contextId"] == "c" and "no open context" in errors[0]["message"] and "JSON" in errors[1]["message"]
    for context, spoken in (("a", ["Hello there."]), ("b", ["How are you today?", "I am well, thank you!"]),
                            ("c", None)):
        final = [k for k, m in enumerate(messages) if m.get("isFinal") and m["contextId"] == context]
        sent = [k for k, m in enumerate(messages) if m.get("audio") and m["contextId"] == context]
        assert len(final) == 1 and sent and max(sent) < final[0]  # isFinal after all of its audio
        got = pcm_of(messages, context)
        want = joined_pcm(codec, [cut] if spoken is None else [codes[text] for text in spoken])
        if spoken is None:  # stopped: a part of its audio, as far as it came
            assert 0 < got.size < want.size / 2 and np.abs(got - want[:got.size]).max() <= 1
        else:
            assert got.shape == want.shape and np.abs(got - want).max() <= 1  # b's join is the decoder's own
    assert state.backend.open_streams == 0


def test_contexts_are_limited_closed_when_silent_and_checked(codec):
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosedError

    quiet = random_codes(codec.config, 4, seed=90)
    with serving(codec) as (server, lm, state):
        lm.script("Quiet now.", quiet)

        async def replies_until_closed(url, send, pause=0.0):
            async with connect(url) as ws:
                for message in send:
                    await ws.send(message if isinstance(message, str) else json.dumps(message))
                    await asyncio.sleep(pause)
                replies = []
                with pytest.raises(ConnectionClosedError):  # a close other than 1000
                    while True:
                        replies.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
                return replies, ws.close_code, ws.close_reason
        too_many = asyncio.run(replies_until_closed(
            ws_url(server), [{"text": " ", "context_id": f"c{k}"} for k in range(6)]))
        silent = asyncio.run(replies_until_closed(
            ws_url(server, output_format="ulaw_8000", inactivity_timeout=1),
            [{"text": " ", "context_id": "q", "voice_settings": {"speed": 0.5}}, {"text": "Quiet now. ", "context_id": "q"}]))
        bad = asyncio.run(replies_until_closed(
            ws_url(server, inactivity_timeout=1),
            [{"text": "Hi. ", "context_id": 7}, {"text": 3}, {"voice_settings": {}},
             {"text": " ", "context_id": "f", "voice_settings": {"speed": 9}}, {"flush": True}]))
    replies, code, reason = too_many  # a sixth open context, as ElevenLabs answers it
    assert code == 1008 and replies[-1]["error"] == "max_active_conversations" and "(5)" in replies[-1]["message"]
    replies, code, reason = silent  # the context spoken and closed for silence, then the connection
    assert [r for r in replies if r.get("isFinal")] == [{"isFinal": True, "contextId": "q"}]
    ulaw = b"".join(base64.b64decode(r["audio"]) for r in replies if r.get("audio"))
    assert len(ulaw) == pytest.approx(4 * 2048 / 3 * 2, abs=300)  # 4 frames at 8 kHz, a byte a sample, at speed 0.5
    assert code == 1008 and "inactivity_timeout" in reason and replies[-1]["error"] == "input_timeout_exceeded"
    replies, code, reason = bad
    assert [r["error"] for r in replies[:4]] == ["invalid_message"] * 4
    assert "context_id" in replies[0]["message"] and "string" in replies[1]["message"]
    assert "needs 'text'" in replies[2]["message"] and "voice_settings.speed" in replies[3]["message"]
    assert code == 1008  # then a flush of no context: nothing, and the connection closed for silence
    assert prompts_of(lm) == ["Quiet now."] and state.backend.open_streams == 0


def test_a_message_the_server_fails_on_ends_the_connection_and_frees_its_slots(codec, monkeypatch, caplog):
    """A bug of ours while a message is handled (here a context's text refused with an error nobody
    expected): the connection closes 1011 ``internal_error`` and its contexts' slots come back; the
    error is in the server's log. (Before, the receiving task died, nothing ended the connection, and
    its slots and the server's shutdown waited for good.)"""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosedError

    from snac_fast.serve.services.spoken_text import SpokenText

    def broken_add(self, text, flush=False):
        if "boom" in text:
            raise ZeroDivisionError("a bug")
    monkeypatch.setattr(SpokenText, "add", broken_add)
    with serving(codec) as (server, lm, state):
        async def run():
            async with connect(ws_url(server)) as ws:
                await ws.send(json.dumps({"text": " ", "context_id": "a"}))
                await ws.send(json.dumps({"text": "boom. ", "context_id": "b"}))
                replies = []
                with pytest.raises(ConnectionClosedError):
                    while True:
                        replies.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
                return replies, ws.close_code
        with caplog.at_level(logging.ERROR, logger="snac_fast.serve"):
            replies, code = asyncio.run(run())
        for _ in range(100):
            if state.backend.open_streams == 0:
                break
            time.sleep(0.01)
        assert state.backend.open_streams == 0
    assert code == 1011 and replies[-1]["error"] == "internal_error"
    assert any("ZeroDivisionError" in (r.exc_text or "") or r.exc_info and r.exc_info[0] is ZeroDivisionError
               for r in caplog.records)


def test_pipecat_speaks_through_the_server(codec):
    """Pipecat's ElevenLabsTTSService (multi-context WebSocket), its url pointed here, in a pipeline
    that speaks one turn; every audio frame it pushes is the decode of the turn's codes."""
    from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSStoppedFrame
    from pipecat.services.elevenlabs.tts import ElevenLabsTTSService

    codes = {text: random_codes(codec.config, n, seed=100 + k)
             for k, (text, n) in enumerate({"Hello there.": 4, "How are you today?": 5}.items())}
    with serving(codec, api_key="sesame") as (server, lm, state):
        for text, c in codes.items():
            lm.script(text, c)

        tts = ElevenLabsTTSService(api_key="sesame", url=server.url.replace("http", "ws"), sample_rate=24000,
                                   settings=ElevenLabsTTSService.Settings(voice="tara"))
        frames = asyncio.run(pipecat_spoken(tts, "Hello there. How are you today?"))
    assert not [f for f in frames if isinstance(f, ErrorFrame)] and any(isinstance(f, TTSStoppedFrame) for f in frames)
    audio = [f for f in frames if isinstance(f, TTSAudioRawFrame)]
    assert {f.sample_rate for f in audio} == {24000}
    pcm = np.frombuffer(b"".join(f.audio for f in audio), "<i2").astype(np.float64)
    want = joined_pcm(codec, list(codes.values()))
    assert prompts_of(lm) == list(codes) and pcm.shape == want.shape and np.abs(pcm - want).max() <= 1
    assert state.backend.open_streams == 0


def test_livekit_speaks_through_the_server(codec):
    """LiveKit Agents' ElevenLabs plugin (its streaming TTS: the multi-context WebSocket), its base
    URL pointed here, fed text in pieces as an agent's LLM writes it."""
    import aiohttp
    from livekit.plugins import elevenlabs

    logging.getLogger("livekit").setLevel(logging.WARNING)
    text = "Hello there. How are you today?"
    codes = random_codes(codec.config, 7, seed=110)
    with serving(codec, api_key="sesame") as (server, lm, state):
        lm.script(text, codes)

        async def speak():
            async with aiohttp.ClientSession() as session:
                tts = elevenlabs.TTS(api_key="sesame", base_url=server.url + "/v1", voice_id="tara",
                                     http_session=session, encoding="pcm_24000")
                frames = []
                async with tts.stream() as stream:
                    for piece in ("Hello there. ", "How are you ", "today?"):
                        stream.push_text(piece)
                    stream.end_input()
                    async for event in stream:
                        frames.append(event.frame)
                await tts.aclose()
                return frames
        frames = asyncio.run(speak())
    assert {f.sample_rate for f in frames} == {24000} and {f.num_channels for f in frames} == {1}
    pcm = np.concatenate([np.frombuffer(bytes(f.data), "<i2") for f in frames]).astype(np.float64)
    want = joined_pcm(codec, [codes])
    # LiveKit sends what its tokenizer gathered as one piece, flushed at the end of input: one LM request
    assert prompts_of(lm) == [text] and pcm.shape == want.shape and np.abs(pcm - want).max() <= 1
    assert state.backend.open_streams == 0


class _Speaker:
    """SpokenText's part a context's watcher sees: a task that ends when told."""

    def __init__(self, server, sid, *_):
        self.sid, self.interrupted = sid, False
        self.task = asyncio.get_running_loop().create_future()

    def cancel(self):
        self.task.cancel()


class _Server:
    """The server's stream slots: which were opened and which given back, in order."""

    def __init__(self):
        self.opened, self.ended = [], []
        self.backend = type("Backend", (), {"rate": 24000})()

    async def open_stream(self, seed, client):
        self.opened.append(len(self.opened))
        return self.opened[-1]

    def stream_ended(self, sid, release=False):
        self.ended.append((sid, release))


def _connection(monkeypatch):
    from types import SimpleNamespace

    from snac_fast.serve.routes import text_contexts

    monkeypatch.setattr(text_contexts, "SpokenText", _Speaker)
    monkeypatch.setattr(text_contexts, "StreamEncoder", lambda *args, **kwargs: None)
    server = _Server()
    ws = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(server=server)),
                         path_params={"voice_id": "tara"}, scope={"client": ("127.0.0.1", 1)})
    return text_contexts._Connection(ws, SimpleNamespace(rate=24000), 20.0), server


@pytest.mark.parametrize("when", ["before_its_first_step", "while_it_waits"])
def test_a_contexts_slot_comes_back_once_when_its_watcher_is_cancelled(monkeypatch, when):
    """The connection ending right after a context opened cancels that context's watcher, perhaps
    before it first ran (then no ``finally`` of its runs: a flood's last context kept its slot for
    good), perhaps while it waits for the speech: either way the slot comes back, once."""
    async def run():
        connection, server = _connection(monkeypatch)
        await connection._open("a", 1.0)
        (watcher,) = connection.watchers
        if when == "while_it_waits":
            await asyncio.sleep(0)  # its first step: waiting on the speaker
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await asyncio.sleep(0)  # done callbacks run on the loop's next turn
        return connection, server

    connection, server = asyncio.run(run())
    assert server.ended == [(0, True)]
    assert not connection.watchers


def test_a_context_that_ends_gives_its_slot_back_once(monkeypatch):
    """A context whose speech ended: its isFinal sent, then its slot back once."""
    async def run():
        connection, server = _connection(monkeypatch)
        sent = []

        async def send(message):
            sent.append(message)

        connection._send = send
        text = await connection._open("a", 1.0)
        (watcher,) = connection.watchers
        text.task.set_result(None)
        await watcher
        await asyncio.sleep(0)
        return server, sent

    server, sent = asyncio.run(run())
    assert sent == [{"isFinal": True, "contextId": "a"}]
    assert server.ended == [(0, True)]
