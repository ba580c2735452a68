"""The speech API as TTS stacks call it, through the official `openai` SDK against a live server:
every response_format (mp3 the default), each decoded back with FFmpeg (PyAV) and held against
the offline decode of the codes the LM sent (lossless formats equal to the int16 PCM, lossy ones
within a stated spectral distance); streaming responses whose every prefix decodes; voices,
models, the API key, readiness, the limits of a request, and the streams' formats themselves."""

import asyncio
import io
import json
import wave

import av
import httpx
import numpy as np
import pytest
import torch
import torchaudio
from helpers import NARROW, random_codes
from live_server import LiveServer, serving

from snac_fast import FastSNAC
from snac_fast.model.synthetic import synthetic_model
from snac_fast.serve import ServeSettings, create_app
from snac_fast.serve.lm.fake import FakeLM
from snac_fast.serve.lm.presets import PRESETS
from snac_fast.serve.services.formats import FORMATS, StreamEncoder, Tempo, int16_samples

RATE = 24000
# lossy formats against the int16 PCM: the long-term spectrum's bands below 8 kHz within this many
# dB on average (64 kb/s each; the synthetic model's audio is broadband noise: measured 0.05-0.41 dB)
LOSSY_BAND_DB = {"mp3": 1.5, "opus": 1.5, "aac": 1.5}
MAGIC = {"mp3": (b"ID3", b"\xff\xf3", b"\xff\xf2", b"\xff\xfb"), "opus": (b"OggS",), "aac": (b"\xff\xf1", b"\xff\xf9"),
         "flac": (b"fLaC",), "wav": (b"RIFF",)}


@pytest.fixture(scope="module")
def codec():
    return FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu", fuse=False)


def expected_pcm(codec, codes, seed) -> np.ndarray:
    """The offline decode as the server's int16 PCM."""
    return int16_samples(codec.decode(codes, seed=seed)[0, 0].float().numpy())


def decoded(data: bytes, name: str, rate: int = RATE) -> tuple[np.ndarray, int]:
    """A response's audio decoded with FFmpeg: (float32 samples in [-1, 1], rate)."""
    if name.startswith("pcm"):
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768, rate
    container = av.open(io.BytesIO(data))
    frames = [f for f in container.decode(audio=0)]
    samples = np.concatenate([f.to_ndarray().reshape(-1) for f in frames])
    if samples.dtype == np.int16:
        samples = samples.astype(np.float32) / 32768
    return samples.astype(np.float32), frames[0].sample_rate


def mp3_samples(data: bytes) -> int:
    """Samples in the whole MP3 frames of ``data`` past its ID3v2 tag, through FFmpeg's MP3 parser
    and decoder (its demuxer probes a few frames before it trusts a file: a first chunk of one frame
    is whole audio it will not open)."""
    at = 10 + sum(b << (7 * (3 - k)) for k, b in enumerate(data[6:10])) if data[:3] == b"ID3" else 0
    parser = av.CodecContext.create("mp3", "r")
    packets = parser.parse(data[at:]) + parser.parse(None)
    return sum(f.samples for p in packets for f in parser.decode(p))


def band_db(x: np.ndarray, rate: int, top_hz: float = 8000.0) -> np.ndarray:
    """Log energy of the long-term spectrum in 32 bands up to ``top_hz`` (delay- and phase-blind)."""
    n = 1024
    frames = np.lib.stride_tricks.sliding_window_view(x, n)[::n // 2] * np.hanning(n)
    power = (np.abs(np.fft.rfft(frames, axis=1)) ** 2).mean(axis=0)
    freqs = np.fft.rfftfreq(n, 1 / rate)
    edges = np.linspace(100, top_hz, 33)
    return np.array([10 * np.log10(power[(freqs >= a) & (freqs < b)].mean() + 1e-12) for a, b in zip(edges, edges[1:])])


def check_audio(name: str, data: bytes, want: np.ndarray) -> None:
    """``data`` (a response of format ``name``) is ``want``'s audio, exactly where lossless."""
    if name in MAGIC:
        assert data.startswith(MAGIC[name]), (name, data[:8])
    got, rate = decoded(data, name)
    want_f = want.astype(np.float32) / 32768
    if name in ("wav", "flac", "pcm"):  # the stream's float32 audio rounds as the decode's, to 1 LSB at ties
        assert rate == RATE and len(got) == len(want), name
        assert np.abs(np.rint(got * 32768).astype(np.int32) - want).max() <= 1, name
        return
    if rate != RATE:  # Ogg Opus decodes at 48 kHz
        got = np.interp(np.arange(len(got) * RATE // rate) * rate / RATE, np.arange(len(got)), got).astype(np.float32)
    assert abs(len(got) - len(want)) <= 2048, (name, len(got), len(want))  # codec priming and padding at most
    distance = np.abs(band_db(got, RATE) - band_db(want_f, RATE)).mean()
    assert distance <= LOSSY_BAND_DB[name], (name, distance)


def test_openai_sdk_plain_call_gets_every_format_and_mp3_by_default(codec):
    from openai import OpenAI

    texts = {fmt: f"hello in {fmt}" for fmt in (None, "mp3", "opus", "aac", "flac", "wav", "pcm")}
    codes = random_codes(codec.config, 14, seed=40)
    with serving(codec) as (server, lm, state):
        for text in texts.values():
            lm.script(text, codes)
        client = OpenAI(base_url=server.url + "/v1", api_key="not-checked", max_retries=0)
        got = {}
        for fmt, text in texts.items():
            options = {} if fmt is None else {"response_format": fmt}
            got[fmt] = client.audio.speech.create(model="orpheus", voice="tara", input=text, extra_body={"seed": 4},
                                                  **options).read()
    want = expected_pcm(codec, codes, 4)
    for fmt in texts:
        check_audio(fmt or "mp3", got[fmt], want)
    pcm = np.frombuffer(got["pcm"], "<i2")
    # lossless (exact for one stream's PCM: test_stream_encoder_chunks_join_to_the_whole): the pcm
    # request's audio to 1 LSB, as another request's frames may step in other groups (as they
    # arrived), which moves a float32 rounding tie
    for fmt in ("flac", "wav"):
        lossless = np.rint(decoded(got[fmt], fmt)[0] * 32768).astype(np.int32)
        assert len(lossless) == len(pcm) and np.abs(lossless - pcm).max() <= 1, fmt


def test_openai_async_streaming_chunks_are_each_a_valid_continuation(codec):
    from openai import AsyncOpenAI

    c = random_codes(codec.config, 20, seed=77)
    with serving(codec) as (server, lm, state):
        for fmt in ("mp3", "opus", "aac", "flac"):
            lm.script(f"streamed {fmt}", c, delay=0.01)

        async def main():
            client = AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            out = {}
            for fmt in ("mp3", "opus", "aac", "flac"):
                async with client.audio.speech.with_streaming_response.create(
                        model="orpheus", voice="leah", input=f"streamed {fmt}", response_format=fmt,
                        extra_body={"seed": 3}) as response:
                    out[fmt] = [chunk async for chunk in response.iter_bytes()]
            return out
        streamed = asyncio.run(main())
    want = expected_pcm(codec, c, 3)
    for fmt, chunks in streamed.items():
        assert len([ch for ch in chunks if ch]) >= 3, fmt  # streamed as produced, not in one piece
        check_audio(fmt, b"".join(chunks), want)
        for k in range(1, len(chunks)):  # every prefix of the body decodes: each chunk continues the last
            prefix = b"".join(chunks[:k])
            if fmt == "mp3":  # the first chunk: one frame (the first audio packet sent alone)
                assert mp3_samples(prefix) >= 576 * k
            elif len(prefix) > 64:
                decoded(prefix, fmt)


def test_rates_and_g711_for_telephony(codec):
    c = random_codes(codec.config, 10, seed=5)
    with serving(codec) as (server, lm, state):
        lm.script("phone", c)
        answers = {}
        for fmt in ("pcm_8000", "pcm_16000", "pcm_48000", "ulaw_8000", "alaw_8000"):
            r = httpx.post(server.url + "/v1/audio/speech", json={"input": "phone", "response_format": fmt, "seed": 2},
                           timeout=60)
            assert r.status_code == 200, r.text
            answers[fmt] = (r.content, int(r.headers["x-sample-rate"]))
        mp3_16k = httpx.post(server.url + "/v1/audio/speech", timeout=60,
                             json={"input": "phone", "response_format": "mp3", "sample_rate": 16000, "seed": 2})
    want = expected_pcm(codec, c, 2).astype(np.float32) / 32768
    for fmt, (data, rate) in answers.items():
        assert rate == int(fmt.split("_")[1])
        if fmt.startswith("pcm"):
            got = np.frombuffer(data, "<i2").astype(np.float32) / 32768
        else:  # G.711: one byte a sample, decoded by FFmpeg
            context = av.CodecContext.create("pcm_mulaw" if fmt.startswith("ulaw") else "pcm_alaw", "r")
            context.sample_rate, context.layout = rate, "mono"
            got = np.concatenate([f.to_ndarray().reshape(-1) for f in context.decode(av.Packet(data))]).astype(np.float32) / 32768
            assert len(data) == len(got)
        assert abs(len(got) - len(want) * rate // RATE) <= 64, fmt
        top = min(3400.0, 0.45 * rate)  # against an independent resampler's (torchaudio's) output
        reference = torchaudio.functional.resample(torch.from_numpy(want), RATE, rate).numpy()
        assert np.abs(band_db(got, rate, top) - band_db(reference, rate, top)).mean() <= 1.5, fmt
    assert mp3_16k.status_code == 200 and decoded(mp3_16k.content, "mp3")[1] == 16000


def test_unstreamed_wav_has_its_true_length(codec):
    c = random_codes(codec.config, 9, seed=8)
    with serving(codec) as (server, lm, state):
        lm.script("whole", c)
        r = httpx.post(server.url + "/v1/audio/speech", json={"input": "whole", "response_format": "wav", "seed": 1,
                                                              "stream": False}, timeout=60)
        streamed = httpx.post(server.url + "/v1/audio/speech", json={"input": "whole", "response_format": "wav",
                                                                     "seed": 1}, timeout=60)
        lm.script("broken late", c, bad_at=7 * 6 + 3)  # after the first audio: a whole file cannot be sent
        broken = httpx.post(server.url + "/v1/audio/speech", json={"input": "broken late", "stream": False}, timeout=60)
        assert slots_freed(state)
    assert broken.status_code == 502 and broken.json()["error"]["type"] == "lm_output_error"
    want = expected_pcm(codec, c, 1)
    with wave.open(io.BytesIO(r.content)) as w:
        assert w.getnframes() == len(want) and w.getframerate() == RATE
        got = np.frombuffer(w.readframes(w.getnframes()), "<i2")
        assert np.abs(got.astype(np.int32) - want).max() <= 1
    assert int(r.headers["content-length"]) == len(r.content)
    assert streamed.content[4:8] == b"\xff\xff\xff\xff"  # streamed: sizes unknown when the header left
    both = [np.frombuffer(x.content[44:], "<i2").astype(np.int32) for x in (streamed, r)]
    assert len(both[0]) == len(both[1]) and np.abs(both[0] - both[1]).max() <= 1  # to 1 LSB: steps grouped as frames arrived


def test_voices_models_limits_and_instructions(codec):
    from openai import BadRequestError, OpenAI

    c = random_codes(codec.config, 5, seed=9)
    with serving(codec) as (server, lm, state):
        lm.script("ok", c)
        client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        ids = [m.id for m in client.models.list()]
        voices = httpx.get(server.url + "/v1/audio/voices").json()
        with pytest.raises(BadRequestError, match="at most 20000"):
            client.audio.speech.create(model="orpheus", voice="tara", input="x" * 20001)
        for speed in (4.5, 0.2):
            with pytest.raises(BadRequestError, match="speed"):
                client.audio.speech.create(model="orpheus", voice="tara", input="ok", speed=speed)
        with pytest.raises(BadRequestError, match="voice"):
            client.audio.speech.create(model="orpheus", voice="alloy", input="ok")
        fine = client.audio.speech.create(model="orpheus", voice="tara", input="ok", speed=1.0,
                                          instructions="Speak cheerfully.", response_format="pcm")
        bad = [httpx.post(server.url + "/v1/audio/speech", json=body).json()["error"] for body in (
            {"input": "ok", "response_format": "mp3", "sample_format": "f32"},
            {"input": "ok", "response_format": "opus", "sample_rate": 44100},
            {"input": "ok", "stream": False, "stream_format": "sse"},
            {"input": "ok", "response_format": "ulaw_8000", "sample_rate": 16000})]
        assert slots_freed(state)
    assert ids[0] == "orpheus" and "tts-1" in ids
    assert voices["voices"] == list(PRESETS["orpheus"].voices)
    assert len(fine.read()) == len(expected_pcm(codec, c, 0)) * 2
    assert [e["param"] for e in bad] == ["sample_format", "sample_rate", "stream", "sample_rate"]


def slots_freed(state, timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while state.backend.engine.open_streams and time.monotonic() < deadline:
        time.sleep(0.02)
    return state.backend.engine.open_streams == 0


def test_api_key_on_every_endpoint_but_health(codec):
    from openai import AuthenticationError, OpenAI
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    c = random_codes(codec.config, 5, seed=10)
    lm = FakeLM(split_tokens=True)
    lm.script("keyed", c)
    with LiveServer(lm.app) as lm_server:
        app = create_app(codec, ServeSettings.of(lm_url=lm_server.url + "/v1", api_key="s3cret-key"))
        with LiveServer(app) as server:
            with pytest.raises(AuthenticationError) as refused:
                OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).audio.speech.create(
                    model="orpheus", voice="tara", input="keyed")
            audio = OpenAI(base_url=server.url + "/v1", api_key="s3cret-key", max_retries=0).audio.speech.create(
                model="orpheus", voice="tara", input="keyed", response_format="wav").read()
            statuses = {path: httpx.get(server.url + path).status_code for path in ("/health", "/ready", "/metrics",
                                                                                   "/v1/models", "/v1/audio/voices")}
            bare = httpx.post(server.url + "/v1/audio/speech", json={"input": "keyed"}, headers={"Authorization": "s3cret-key"})

            async def websocket(headers):
                async with connect(server.url.replace("http", "ws") + "/v1/audio/stream", additional_headers=headers) as ws:
                    await ws.send(json.dumps({"end": True}))
                    return json.loads(await ws.recv())
            with pytest.raises(InvalidStatus):
                asyncio.run(websocket({}))
            done = asyncio.run(websocket({"Authorization": "Bearer s3cret-key"}))
    assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
    assert audio[:4] == b"RIFF"
    assert statuses == {"/health": 200, "/ready": 401, "/metrics": 401, "/v1/models": 401, "/v1/audio/voices": 401}
    assert bare.status_code == 401  # the scheme is part of the key's form
    assert done == {"type": "done"}


def test_health_reports_the_lm_and_ready_waits_for_it(codec):
    app = create_app(codec, ServeSettings.of(lm_url="http://127.0.0.1:9/v1"))
    with LiveServer(app) as server:
        health, ready = httpx.get(server.url + "/health"), httpx.get(server.url + "/ready")
    assert health.status_code == 200 and health.json()["lm"]["status"] == "unreachable"
    assert "127.0.0.1:9" in health.json()["lm"]["error"]
    assert ready.status_code == 503 and ready.json()["ready"] is False
    lm = FakeLM()
    with LiveServer(lm.app) as lm_server, LiveServer(create_app(codec, ServeSettings.of(lm_url=lm_server.url + "/v1"))) as s:
        assert httpx.get(s.url + "/ready").json()["ready"] is True


def test_websocket_names_a_message_it_does_not_know(codec):
    from websockets.asyncio.client import connect

    with serving(codec) as (server, lm, state):
        async def main():
            async with connect(server.url.replace("http", "ws") + "/v1/audio/stream") as ws:
                replies = []
                for message in ({"prompt": "tara: hello"}, {"speak": 1}, [1, 2], {"ids": "128266"}):
                    await ws.send(json.dumps(message))
                    replies.append(json.loads(await ws.recv()))
                await ws.send(json.dumps({"end": True}))
                replies.append(json.loads(await ws.recv()))
                return replies
        replies = asyncio.run(main())
    assert [r["type"] for r in replies] == ["error"] * 4 + ["done"]
    assert "POST /v1/audio/speech" in replies[0]["message"] and "speak" in replies[1]["message"]


@pytest.mark.parametrize("name", ["mp3", "opus", "aac", "flac", "wav", "pcm", "ulaw_8000"])
def test_stream_encoder_chunks_join_to_the_whole(name):
    """The encoder alone: chunks of any size give the bytes of one whole encode (the same stream
    state), and a lossless one decodes to the int16 PCM exactly."""
    rng = np.random.default_rng(1)
    audio = (0.2 * rng.standard_normal(RATE)).astype(np.float32)
    whole = StreamEncoder(FORMATS[name], RATE)
    one = whole.encode(audio) + whole.finish()
    pieces = StreamEncoder(FORMATS[name], RATE)
    cuts = np.cumsum(rng.integers(1, 3000, 40))
    parts = [pieces.encode(p) for p in np.split(audio, cuts[cuts < len(audio)])] + [pieces.finish()]
    assert b"".join(parts) == one or name in ("opus",)  # Ogg pages follow the packets, not the chunks
    if name in ("flac", "wav", "pcm"):
        got, _ = decoded(b"".join(parts), name)
        assert np.array_equal(np.rint(got * 32768).astype(np.int16), int16_samples(audio))
    if name == "opus":
        got, rate = decoded(b"".join(parts), name)
        assert rate == 48000 and abs(len(got) - 2 * len(audio)) <= 2 * 960


@pytest.mark.parametrize("name,speed,seekable", [("mp3", 1.0, False), ("mp3", 1.25, False), ("opus", 1.0, False),
                                                   ("aac", 1.0, False), ("flac", 1.0, False), ("wav", 1.0, True),
                                                   ("wav", 1.0, False), ("mp3", 1.0, True),
                                                   ("pcm_16000", 1.0, False), ("ulaw_8000", 1.0, False)])
def test_an_encoder_opened_ahead_writes_the_same_bytes(name, speed, seekable):
    """prepare() (the encoder opened, the container's header written, before any audio) changes no
    byte: the header comes with the first encode, as it did when the first encode opened it."""
    rng = np.random.default_rng(3)
    audio = (0.2 * rng.standard_normal(RATE)).astype(np.float32)
    cuts = np.cumsum(rng.integers(1, 5000, 12))
    pieces = np.split(audio, cuts[cuts < len(audio)])
    out = []
    for ahead in (False, True):
        encoder = StreamEncoder(FORMATS[name], RATE, seekable=seekable, speed=speed)
        if ahead:
            encoder.prepare()
            encoder.prepare()  # twice changes nothing either
        out.append(b"".join(encoder.encode(p) for p in pieces) + encoder.finish())
    assert out[0] == out[1] and len(out[0]) > 1000


@pytest.mark.parametrize("name,rate,most", [("mp3", RATE, 2304), ("mp3", 44100, 3 * 1152), ("aac", RATE, 3 * 1024),
                                             ("opus", RATE, 4 * 480), ("flac", RATE, 2304), ("mp3", 16000, 5 * 576)])
def test_the_first_audio_packet_comes_alone_and_the_bytes_do_not_change(name, rate, most):
    """encode_head: the shortest start of the first piece, in the encoder's frames, that brings its
    first audio packet out (a decodable frame, not only the container's header); with the rest and
    the later pieces the bytes of encodes that never split (Ogg's pages follow the packets: opus
    decodes to the same samples); nothing split after the first packet."""
    rng = np.random.default_rng(5)
    audio = (0.2 * rng.standard_normal(RATE)).astype(np.float32)
    pieces = [audio[:8192], audio[8192:9000], audio[9000:]]
    plain = StreamEncoder(FORMATS[name], RATE, rate)
    whole = b"".join(plain.encode(p) for p in pieces) + plain.finish()
    split = StreamEncoder(FORMATS[name], RATE, rate)
    split.prepare()
    head, rest = split.encode_head(pieces[0])
    assert 0 < pieces[0].size - rest.size <= most and np.array_equal(rest, pieces[0][pieces[0].size - rest.size:])
    header = StreamEncoder(FORMATS[name], RATE, rate)
    header.prepare()
    assert len(head) > len(header.encode(audio[:0]))  # more than the header: an audio packet
    later = split.encode_head(pieces[1])
    assert later[0] == b"" and later[1] is pieces[1]
    joined = head + b"".join(split.encode(p) for p in (rest, *pieces[1:])) + split.finish()
    if name == "opus":
        assert np.array_equal(decoded(joined, name)[0], decoded(whole, name)[0])
    else:
        assert joined == whole
    if name == "mp3":
        assert mp3_samples(head) >= 576  # the head alone decodes


@pytest.mark.parametrize("name", ["pcm", "wav", "ulaw_8000", "pcm_16000"])
def test_an_encoder_that_holds_no_frames_splits_nothing(name):
    audio = np.zeros(4000, np.float32)
    encoder = StreamEncoder(FORMATS[name], RATE)
    head, rest = encoder.encode_head(audio)
    assert head == b"" and rest is audio
    seekable = StreamEncoder(FORMATS["mp3"], RATE, seekable=True)  # its bytes come whole at the end
    assert seekable.encode_head(audio)[1] is audio


def test_in_a_burst_every_streams_first_audio_comes_before_any_rest():
    """encoded(): streams whose first pieces are ready at once on one event loop each send their first
    MP3 frame before any of them encodes the rest of its piece: the burst's last first audio waits
    on the others' heads (~1.7 ms each), not on their whole first pieces (~6.6 ms)."""
    from snac_fast.serve.services.formats import encoded

    rng = np.random.default_rng(6)
    order = []

    async def source(piece):
        yield piece

    async def stream(k, piece):
        async for data in encoded(StreamEncoder(FORMATS["mp3"], RATE), source(piece)):
            order.append((k, len(data)))

    async def main():
        await asyncio.gather(*(stream(k, (0.2 * rng.standard_normal(8192)).astype(np.float32)) for k in range(6)))

    asyncio.run(main())
    firsts = [order.index(next(o for o in order if o[0] == k)) for k in range(6)]
    assert sorted(firsts) == list(range(6)), order  # six first audios, then the rests
    assert all(sum(1 for o in order if o[0] == k) >= 3 for k in range(6))  # head, rest, end


def test_mp3_at_the_models_rate_equals_ffmpegs_own_conversion():
    """Mono int16 at the output rate goes into LAME as its planar int16 samples without a resampler:
    the bytes of FFmpeg's resampler to LAME's first format (s32p) in front of the same encoder and muxer."""
    from fractions import Fraction

    rng = np.random.default_rng(4)
    audio = (0.3 * rng.standard_normal(RATE)).astype(np.float32)
    encoder = StreamEncoder(FORMATS["mp3"], RATE, seekable=True)  # into a BytesIO, as the reference's
    ours = b"".join(encoder.encode(p) for p in np.array_split(audio, 7)) + encoder.finish()
    sink = io.BytesIO()
    container = av.open(sink, mode="w", format="mp3", options={"fflags": "+bitexact"})
    stream = container.add_stream("libmp3lame", rate=RATE, layout="mono")
    stream.codec_context.format = "s32p"
    stream.codec_context.bit_rate = 64000
    resampler = av.AudioResampler(format="s32p", layout="mono", rate=RATE)
    at = 0
    for piece in np.array_split(audio, 7):
        frame = av.AudioFrame.from_ndarray(int16_samples(piece)[None], format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = RATE, at, Fraction(1, RATE)
        at += len(piece)
        for converted in resampler.resample(frame):
            for packet in stream.encode(converted):
                container.mux(packet)
    for converted in resampler.resample(None):
        for packet in stream.encode(converted):
            container.mux(packet)
    for packet in stream.encode(None):
        container.mux(packet)
    container.close()
    assert ours == sink.getvalue()


def test_the_encoder_opens_after_the_lm_request_and_before_the_first_audio(codec, monkeypatch):
    """A speech request's encoder opens once the LM's first ids are in (the LM request went out
    before it, and the LM still makes the first frames), once, and before its first encode: its
    set-up is off the way to the first audio."""
    import time

    events = []
    prepare, encode = StreamEncoder.prepare, StreamEncoder.encode

    def prepared(self):
        events.append(("prepare", time.monotonic()))
        prepare(self)

    def encoded(self, audio):
        events.append(("encode", time.monotonic()))
        return encode(self, audio)

    monkeypatch.setattr(StreamEncoder, "prepare", prepared)
    monkeypatch.setattr(StreamEncoder, "encode", encoded)
    codes = random_codes(codec.config, 12, seed=8)
    with serving(codec) as (server, lm, state):
        lm.script("open it early", codes, delay=0.02)
        events.clear()  # the server's start-up encodes a warm-up frame
        response = httpx.post(server.url + "/v1/audio/speech", json={"model": "orpheus", "voice": "tara",
                              "input": "open it early", "response_format": "mp3", "seed": 2}, timeout=60)
        asked = lm.received["open it early"]
    assert response.status_code == 200
    check_audio("mp3", response.content, expected_pcm(codec, codes, 2))
    names = [name for name, _ in events]
    assert names.count("prepare") == 1 and names[0] == "prepare" and "encode" in names, names
    assert events[0][1] > asked


@pytest.mark.parametrize("speed", [1.5, 0.3])
def test_speed_scales_time_keeps_pitch_and_ignores_chunking(speed):
    """The encoder's speed (FFmpeg's atempo): audio speed times as short, a tone's pitch where it
    was, and chunks of any size give the samples of one whole pass."""
    rng = np.random.default_rng(2)
    t = np.arange(2 * RATE) / RATE
    tone = (0.4 * np.sin(2 * np.pi * 330 * t)).astype(np.float32)
    whole = StreamEncoder(FORMATS["pcm"], RATE, speed=speed)
    one = np.frombuffer(whole.encode(tone) + whole.finish(), "<i2").astype(np.float64)
    pieces = StreamEncoder(FORMATS["pcm"], RATE, speed=speed)
    cuts = np.cumsum(rng.integers(1, 3000, 40))
    parts = [pieces.encode(p) for p in np.split(tone, cuts[cuts < len(tone)])] + [pieces.finish()]
    assert b"".join(parts) == one.astype("<i2").tobytes()
    assert abs(len(one) - len(tone) / speed) <= 0.01 * len(tone) / speed
    spectrum = np.abs(np.fft.rfft(one * np.hanning(len(one))))
    assert abs(np.argmax(spectrum) * RATE / len(one) - 330) <= 2  # the pitch kept (a resample would move it)


def test_the_sdk_gets_speed_applied_to_the_decode(codec):
    """speed 1.25 through the openai SDK: the offline decode's PCM through atempo in one pass (to the
    1 LSB by which the server's steps, grouped as frames arrive, may round otherwise)."""
    from openai import OpenAI

    c = random_codes(codec.config, 8, seed=12)
    with serving(codec) as (server, lm, state):
        lm.script("Faster, please.", c)
        client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        got = client.audio.speech.create(model="orpheus", voice="tara", input="Faster, please.", speed=1.25,
                                         response_format="pcm", extra_body={"seed": 4}).read()
        assert slots_freed(state)
    tempo = Tempo(1.25, RATE, "s16")
    pcm = expected_pcm(codec, c, 4)
    frame = av.AudioFrame.from_ndarray(pcm[None], format="s16", layout="mono")
    frame.sample_rate = RATE
    want = np.concatenate([f.to_ndarray().reshape(-1) for f in tempo.frames(frame) + tempo.frames(None)])
    got = np.frombuffer(got, "<i2").astype(np.float64)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1  # the server's PCM is the decode's to 1 LSB
