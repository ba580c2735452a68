"""Every SNAC text-to-speech model through `serve`: the preset found from the LM's model name (no
flag), the prompt each sends equal to its authors' template (the source named per case), the
voices each takes, and the audio, through the `openai` SDK and ElevenLabs' text WebSocket, equal to
the offline decode of the codes the stand-in LM (playing that model) sent, to 1 LSB."""

import asyncio
import base64
import json
import logging
from urllib.parse import quote

import httpx
import numpy as np
import pytest
from helpers import joined_pcm, quiet_codec, random_codes
from live_server import serving

from snac_fast.serve.lm.presets import PRESETS, choose_preset
from snac_fast.serve.services.formats import int16_samples
from snac_fast.serve.settings import ServeSettings

# (preset, the model name its LM reports, a voice it takes, the prompt its authors' code sends for
# that voice and the text "Hallo, wie geht es?", the source)
CASES = [
    ("orpheus", "canopylabs/orpheus-3b-0.1-ft", "leo",
     "<custom_token_3><|begin_of_text|>leo: Hallo, wie geht es?<|eot_id|><custom_token_4><custom_token_5><custom_token_1>",
     "canopyai/Orpheus-TTS orpheus_tts/engine_class.py _format_prompt"),
    ("orpheus-fr", "canopylabs/3b-fr-ft-research_release", "amelie",
     "<custom_token_3><|begin_of_text|>amelie: Hallo, wie geht es?<|eot_id|><custom_token_4><custom_token_5><custom_token_1>",
     "canopyai/Orpheus-TTS README (multilingual family: the English prompt, each language's voices)"),
    ("orpheus-de", "lex-au/Orpheus-3b-German-FT-Q8_0.gguf", "thomas",
     "<custom_token_3><|begin_of_text|>thomas: Hallo, wie geht es?<|eot_id|><custom_token_4><custom_token_5><custom_token_1>",
     "Lex-au/Orpheus-FastAPI README v1.3.0 (German voices)"),
    ("maya1", "maya-research/maya1", "Female voice in her 30s with a warm, calm tone",
     '<custom_token_3><|begin_of_text|><description="Female voice in her 30s with a warm, calm tone"> Hallo, wie geht es?'
     "<|eot_id|><custom_token_4><custom_token_5><custom_token_1>",
     "chriswritescode-dev/maya1-fastapi hf_space/app.py build_prompt"),
    ("veena", "maya-research/Veena", "agastya",
     "<custom_token_3><spk_agastya> Hallo, wie geht es?<custom_token_4><custom_token_5><custom_token_1>",
     "maya-research/Veena model card"),
    ("svara-v1", "Kenpath/svara-tts-v1", "Hindi (Male)",
     "<|begin_of_text|><custom_token_3><|audio|>Hindi (Male): Hallo, wie geht es?<custom_token_4><|eot_id|>"
     "<custom_token_5><custom_token_1>", "Kenpath/svara-tts-inference tts_engine/encoder.py svara_text_to_tokens"),
    ("svara-v2", "kenpath/svara-tts-v2", "Priya",
     "<|begin_of_text|><custom_token_3><|audio|>Priya: Hallo, wie geht es?<custom_token_4><|eot_id|>"
     "<custom_token_5><custom_token_1>", "Kenpath/svara-tts-inference tts_engine/encoder.py, voice_config.py"),
    ("snortts", "snorbyte/snorTTS-Indic-v0", "hindi159",
     "<custom_token_3><|begin_of_text|>hindi159: Hallo, wie geht es?<|eot_id|><custom_token_4><custom_token_5><custom_token_1>",
     "SaudxInu/indic-tts scripts/modal/snorTTS_Indic_v0_server.py"),
    ("kartoffel", "SebastianBodza/Kartoffel_Orpheus-3B_german_natural-v0.1", "Martin",
     "<custom_token_3><|begin_of_text|>Martin: Hallo, wie geht es?<|eot_id|><custom_token_4>",
     "SebastianBodza/Orpheus_Distributed_FastAPI streaming_api_server.py format_prompt_for_vllm_sync"),
    # VyvoTTS sends ids: [start of human] + tokenizer("voice: text") + [end of text, end of human],
    # written here as each base's tokenizer names them (LFM2 adds its start of text 1, Qwen3 none)
    ("vyvotts", "Vyvo/VyvoTTS-LFM2-Neuvillette", "EN_B00000_S00010",
     "<custom_token_3><|startoftext|>EN_B00000_S00010: Hallo, wie geht es?<|im_end|><custom_token_4>",
     "Vyvo-Labs/VyvoTTS vyvotts/inference/base.py _build_prompt_tokens, configs/inference/lfm2.yaml"),
    ("vyvotts-qwen3", "someone/VyvoTTS-Qwen3-0.6B-ft", "EN_B00000_S00020",
     "<custom_token_3>EN_B00000_S00020: Hallo, wie geht es?<|im_end|><custom_token_4>",
     "Vyvo-Labs/VyvoTTS vyvotts/inference/base.py _build_prompt_tokens, configs/inference/qwen3.yaml"),
    ("vyvotts-llama3", "someone/vyvotts-llama3.2-1b", "EN_B00000_S00030",
     "<custom_token_3><|begin_of_text|>EN_B00000_S00030: Hallo, wie geht es?<|eot_id|><custom_token_4>",
     "Vyvo-Labs/VyvoTTS vyvotts/inference/base.py _build_prompt_tokens, configs/inference/llama3.yaml"),
]
TEXT = "Hallo, wie geht es?"


def expected_pcm(codec, codes, seed) -> np.ndarray:
    """The offline decode as the server's int16 PCM."""
    return int16_samples(codec.decode(codes, seed=seed)[0, 0].float().numpy())


@pytest.fixture(scope="module")
def codec():
    return quiet_codec()


@pytest.mark.parametrize("name, model, voice, prompt, source", CASES, ids=[c[0] for c in CASES])
def test_each_preset_sends_its_authors_prompt(name, model, voice, prompt, source):
    """The prompt each preset renders is the one its authors' code builds (``source``), and the
    model name its LM reports chooses it."""
    preset, why = choose_preset(model)
    assert preset.name == name and model in why, (source, why)
    assert preset.voice_problem(voice) is None
    assert preset.render(voice, TEXT) == prompt, source
    assert preset.parse(prompt) == (voice, TEXT)


def test_a_name_no_preset_matches_is_orpheus_saying_so_and_the_flag_wins():
    preset, why = choose_preset("meta-llama/Llama-3.2-3B")
    assert preset.name == "orpheus" and "matches no preset" in why
    assert choose_preset("maya-research/maya1", "veena")[0].name == "veena"
    with pytest.raises(ValueError, match="--lm-preset must be one of"):
        choose_preset(None, "bark")


@pytest.mark.parametrize("name, model, voice, prompt, source", CASES, ids=[c[0] for c in CASES])
def test_each_preset_end_to_end_through_the_openai_sdk(codec, caplog, name, model, voice, prompt, source):
    """A server pointed at an LM reporting ``model`` (no flag) speaks that model's prompt and
    sampling; the audio is the offline decode of the codes the LM sent, to 1 LSB."""
    from openai import OpenAI

    preset = PRESETS[name]
    codes = random_codes(codec.config, 9, seed=len(name))
    with caplog.at_level(logging.INFO, logger="snac_fast.serve"), \
            serving(codec, lm_options={"preset": name, "model_name": model}) as (server, lm, state):
        lm.script(TEXT, codes)
        client = OpenAI(base_url=server.url + "/v1", api_key="not-checked", max_retries=0)
        pcm = client.audio.speech.create(model="tts-1", voice=voice, input=TEXT, response_format="pcm",
                                         extra_body={"seed": 5}).read()
        listed = httpx.get(server.url + "/v1/audio/voices").json()["voices"]
        health = httpx.get(server.url + "/health").json()
    assert state.lm.preset is preset and f"LM preset {name}" in caplog.text, caplog.text
    assert health["lm"]["preset"] == name
    assert lm.prompts == [prompt], source
    body = lm.requests[0]
    assert (body["temperature"], body["top_p"], body["repetition_penalty"], body["max_tokens"]) == \
        (preset.temperature, preset.top_p, preset.repetition_penalty, preset.max_tokens)
    assert all(body[k] == v for k, v in preset.extra.items())
    got = np.frombuffer(pcm, "<i2").astype(np.int32)
    want = expected_pcm(codec, codes, 5).astype(np.int32)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1
    assert all(preset.voice_problem(v) is None for v in listed)
    assert listed or not (preset.voices or preset.described or preset.default_voice)  # Kartoffel's: any name


@pytest.mark.parametrize("name", ["maya1", "svara-v1", "kartoffel", "vyvotts"])
def test_each_preset_through_elevenlabs_text_websocket(codec, name):
    """ElevenLabs' stream-input with a preset's voice: the prompt is the preset's, the audio exact."""
    from websockets.asyncio.client import connect

    model = next(c[1] for c in CASES if c[0] == name)
    voice = {"maya1": "nova", "svara-v1": "Tamil (Female)", "kartoffel": "Jana", "vyvotts": "EN_B00000_S00050"}[name]
    preset = PRESETS[name]
    codes = random_codes(codec.config, 7, seed=3)
    with serving(codec, lm_options={"preset": name, "model_name": model}) as (server, lm, state):
        lm.script("Guten Morgen.", codes)

        async def talk() -> bytes:
            url = server.url.replace("http", "ws") + f"/v1/text-to-speech/{quote(voice)}/stream-input?output_format=pcm_24000"
            audio = []
            async with connect(url) as ws:
                await ws.send(json.dumps({"text": " "}))
                await ws.send(json.dumps({"text": "Guten Morgen. ", "flush": True}))
                await ws.send(json.dumps({"text": ""}))
                while True:
                    message = json.loads(await asyncio.wait_for(ws.recv(), 60))
                    if message.get("audio"):
                        audio.append(base64.b64decode(message["audio"]))
                    if message.get("isFinal"):
                        return b"".join(audio)
        pcm = asyncio.run(talk())
    assert lm.prompts == [preset.render(voice, "Guten Morgen.")]
    got = np.frombuffer(pcm, "<i2").astype(np.float64)
    want = joined_pcm(codec, [codes])  # the quiet codec's noise is zero: unseeded streams compare exactly
    assert got.shape == want.shape and np.abs(got - want).max() <= 1


@pytest.mark.parametrize("name, good, bad", [("orpheus", "zoe", "alloy"), ("snortts", "tamil7", "Tamil (Male)"),
                                             ("svara-v2", "Yash", "yash"), ("veena", "maitri", "kavya2")])
def test_a_voice_the_preset_does_not_know_is_a_400_naming_its_voices(codec, name, good, bad):
    model = next(c[1] for c in CASES if c[0] == name)
    with serving(codec, lm_options={"preset": name, "model_name": model}) as (server, lm, state):
        ok = httpx.post(server.url + "/v1/audio/speech", json={"input": "Hi.", "voice": good, "response_format": "pcm"})
        refused = httpx.post(server.url + "/v1/audio/speech", json={"input": "Hi.", "voice": bad})
        eleven = httpx.post(server.url + f"/v1/text-to-speech/{bad}", json={"text": "Hi."})
    assert ok.status_code == 200
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "voice"
    message = refused.json()["error"]["message"]
    assert PRESETS[name].title in message and repr(bad) in message
    assert eleven.status_code == 400 and PRESETS[name].title in json.dumps(eleven.json())


def test_the_stand_in_lm_refuses_a_prompt_not_in_its_presets_form(codec):
    """The fake LM playing Maya1 answers an Orpheus prompt with a 400: a wrong preset cannot pass."""
    with serving(codec, lm_options={"preset": "maya1", "model_name": "maya-research/maya1"}, lm_preset="orpheus",
                 voice="tara") as (server, lm, state):
        answer = httpx.post(server.url + "/v1/audio/speech", json={"input": "Hi.", "voice": "tara"})
    assert answer.status_code == 502 and "maya1's form" in answer.json()["error"]["message"]


def test_voice_flags_are_checked_against_the_preset():
    with pytest.raises(ValueError, match="--voice 'alloy' is not one of the orpheus preset's voices"):
        ServeSettings.of(lm_preset="orpheus", voice="alloy").check()
    ServeSettings.of(lm_preset="maya1", voice="alloy").check()  # an OpenAI name Maya1 maps to a description
    with pytest.raises(ValueError, match="--voice 'x' is not one of --voices's voices"):
        ServeSettings.of(voices="a,b", voice="x").check()
