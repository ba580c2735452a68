"""`POST /v1/text-to-speech/{voice}[/stream]` (ElevenLabs' HTTP speech): their own Python SDK and
LiveKit's plugin (`synthesize`) with their base URL pointed here, and the refusals."""

import asyncio
import base64
import io

import httpx
import numpy as np
import pytest
from helpers import joined_pcm, pipecat_spoken, quiet_codec, random_codes
from live_server import serving

TEXT = "Hello there. How are you today?"


@pytest.fixture(scope="module")
def codec():
    return quiet_codec()


def test_the_elevenlabs_sdk_and_livekit_speak_through_the_http_routes(codec):
    import aiohttp
    import av
    import elevenlabs
    from livekit.plugins import elevenlabs as livekit_elevenlabs

    codes = random_codes(codec.config, 6, seed=120)
    with serving(codec, api_key="sesame") as (server, lm, state):
        lm.script(TEXT, codes)
        client = elevenlabs.ElevenLabs(api_key="sesame", base_url=server.url)
        whole = b"".join(client.text_to_speech.convert(voice_id="tara", text=TEXT, output_format="pcm_24000",
                                                        model_id="eleven_flash_v2_5", seed=7))
        mp3 = b"".join(client.text_to_speech.stream(voice_id="tara", text=TEXT, output_format="mp3_44100_128"))
        faster = httpx.post(server.url + "/v1/text-to-speech/tara", json={"text": TEXT, "voice_settings": {"speed": 1.2}},
                            headers={"xi-api-key": "sesame"}, params={"output_format": "pcm_24000"}, timeout=60)

        async def livekit():
            async with aiohttp.ClientSession() as session:
                tts = livekit_elevenlabs.TTS(api_key="sesame", base_url=server.url + "/v1", voice_id="tara",
                                             http_session=session, encoding="pcm_24000")
                async with tts.synthesize(TEXT) as stream:
                    frames = [event.frame async for event in stream]
                await tts.aclose()
                return frames
        frames = asyncio.run(livekit())
    want = joined_pcm(codec, [codes])  # noise gains zeroed: the seed leaves the audio as it is
    got = np.frombuffer(whole, "<i2").astype(np.float64)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1
    heard = np.concatenate([np.frombuffer(bytes(f.data), "<i2") for f in frames]).astype(np.float64)
    assert {f.sample_rate for f in frames} == {24000} and np.abs(heard[:want.size] - want).max() <= 1
    assert heard.size - want.size < 2 * 240 and not heard[want.size:].any()  # LiveKit pads to its 10 ms frames
    container = av.open(io.BytesIO(mp3))
    assert container.format.name == "mp3" and container.streams.audio[0].rate == 44100
    decoded = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])
    assert abs(decoded.size - want.size * 44100 / 24000) < 2 * 1152  # within two MP3 frames of the audio's length
    assert faster.status_code == 200 and abs(len(faster.content) / 2 - want.size / 1.2) < 0.01 * want.size
    assert len(lm.prompts) == 4 and state.backend.open_streams == 0


def test_the_http_routes_refuse_in_elevenlabs_shape(codec):
    with serving(codec, api_key="sesame") as (server, lm, state):
        key = {"xi-api-key": "sesame"}

        def post(path, body, headers=key, **query):
            return httpx.post(server.url + path, json=body, headers=headers, params=query, timeout=60)
        replies = [post("/v1/text-to-speech/alloy", {"text": "Hi."}),
                   post("/v1/text-to-speech/tara/stream", {"text": "Hi."}, output_format="opus_48000_64"),
                   post("/v1/text-to-speech/tara", {"input": "Hi."}),
                   post("/v1/text-to-speech/tara", {"text": "Hi.", "seed": "many"}),
                   post("/v1/text-to-speech/tara", {"text": "x" * 20001}),
                   post("/v1/text-to-speech/tara", {"text": "Hi.", "voice_settings": {"speed": 9}})]
        no_key = post("/v1/text-to-speech/tara", {"text": "Hi."}, headers={})
    assert [r.status_code for r in replies] == [400] * 6 and no_key.status_code == 401
    messages = [r.json()["detail"]["message"] for r in replies]
    assert "voice_id" in messages[0] and "output_format" in messages[1] and "'text'" in messages[2]
    assert "'seed'" in messages[3] and "at most 20000" in messages[4] and "voice_settings.speed" in messages[5]
    assert lm.prompts == [] and state.backend.open_streams == 0


def test_pipecat_speaks_through_the_with_timestamps_route(codec):
    """Pipecat's ElevenLabsHttpTTSService (POST .../stream/with-timestamps), its base URL pointed
    here; and the whole-file form of the route."""
    import aiohttp
    from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame
    from pipecat.services.elevenlabs.tts import ElevenLabsHttpTTSService

    codes = {text: random_codes(codec.config, n, seed=130 + k) for k, (text, n) in enumerate({TEXT: 9, "Hi.": 4}.items())}
    with serving(codec, api_key="sesame") as (server, lm, state):
        for text, c in codes.items():
            lm.script(text, c)

        async def speak():
            async with aiohttp.ClientSession() as session:
                tts = ElevenLabsHttpTTSService(api_key="sesame", base_url=server.url, aiohttp_session=session,
                                               sample_rate=24000, settings=ElevenLabsHttpTTSService.Settings(voice="tara"))
                return await pipecat_spoken(tts, TEXT)
        frames = asyncio.run(speak())
        whole = httpx.post(server.url + "/v1/text-to-speech/tara/with-timestamps", json={"text": "Hi."},
                           headers={"xi-api-key": "sesame"}, params={"output_format": "pcm_24000"}, timeout=60)
    assert not [f for f in frames if isinstance(f, ErrorFrame)]
    pcm = np.frombuffer(b"".join(f.audio for f in frames if isinstance(f, TTSAudioRawFrame)), "<i2").astype(np.float64)
    want = joined_pcm(codec, [codes[TEXT]])
    assert pcm.shape == want.shape and np.abs(pcm - want).max() <= 1
    body = whole.json()
    assert whole.status_code == 200 and body["alignment"] is None and body["normalized_alignment"] is None
    one = np.frombuffer(base64.b64decode(body["audio_base64"]), "<i2").astype(np.float64)
    assert np.abs(one - joined_pcm(codec, [codes["Hi."]])).max() <= 1 and state.backend.open_streams == 0
