"""What a server must get right around each text-to-speech LM that writes SNAC 24 kHz tokens: its
prompt, how a voice is named, its stop, its sampling. Every model here writes its audio the same
way (``<custom_token_N>``, 7 ids a frame, Orpheus's slot order and offsets: :data:`~snac_fast.orpheus.ORPHEUS`);
only what is around the audio differs. One table (:data:`PRESETS`), each entry citing the code its
authors run; :func:`choose_preset` picks one from the LM's model name (``GET {lm_url}/models``) or
``--lm-preset``.

Prompts are sent as text with the special tokens written as the tokenizer names them
(``<custom_token_3>`` is start of human, 128259; ``<custom_token_4>`` end of human; ``<custom_token_5>``
start of AI; ``<custom_token_1>`` start of speech, 128257; ``<custom_token_2>`` end of speech), which
is what the authors' servers send to vLLM as well (VyvoTTS' LFM2 and Qwen3 models too: their
audio tokens were added to those tokenizers under the same names). Not here: mini-omni (parallel
streams, not a completions API), Kani-TTS (NeMo NanoCodec, not SNAC), VyvoTTS on LFM2.5 (Mimi).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from snac_fast.orpheus import END_OF_SPEECH

ORPHEUS_TAGS = ("<laugh>", "<chuckle>", "<sigh>", "<cough>", "<sniffle>", "<groan>", "<yawn>", "<gasp>")
# the prompt canopylabs' Orpheus fine-tunes were trained on: start of human, the tokenizer's start of
# text, "voice: text", end of text (<|eot_id|>), end of human, start of AI, start of speech
ORPHEUS_WRAP = "<custom_token_3><|begin_of_text|>{speaker}{text}<|eot_id|><custom_token_4><custom_token_5><custom_token_1>"
DESCRIPTION_LIMIT = 500  # characters of a described voice (Maya1)
# a speaker named in "speaker: text" where any name goes (Kartoffel's, VyvoTTS'): no colon, no tag
SPEAKER_NAME = r"[^\s:<>][^:<>]{0,63}"


@dataclass(frozen=True)
class Preset:
    """One model family's side of a completions request. ``prompt``: the text sent, with
    ``{speaker}`` (``speaker`` filled with the voice, or empty where the model takes none) and
    ``{text}``. Voices: ``voices`` by name; ``voice_pattern`` a form of id instead (snorTTS's
    ``hindi159``); ``described`` names that stand for descriptions, with any longer text a
    description itself (Maya1). ``starts_speech``: the model writes start of AI and start of speech
    itself, and its audio counts from start of speech. Sampling: the authors' defaults, each
    overridden by the server's flag when given; ``extra``: request fields the authors send beside
    them (vLLM's ``stop_token_ids``, ``top_k``, ...)."""

    name: str
    title: str
    patterns: tuple[str, ...]
    prompt: str
    speaker: str
    voices: tuple[str, ...]
    default_voice: str
    source: str
    voice_pattern: str | None = None
    described: tuple[tuple[str, str], ...] = ()
    tags: tuple[str, ...] = ORPHEUS_TAGS
    starts_speech: bool = False
    temperature: float = 0.6
    top_p: float = 0.8
    repetition_penalty: float = 1.3
    max_tokens: int = 4096
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    def voice_problem(self, voice: str) -> str | None:
        """Why ``voice`` is not one of this preset's (naming the preset's voices), or None."""
        if voice in self.voices or voice in dict(self.described) or voice == self.default_voice == "":
            return None
        if self.voice_pattern and re.fullmatch(self.voice_pattern, voice):
            return None
        if self.described and " " in voice.strip() and len(voice) <= DESCRIPTION_LIMIT and not set('<>"') & set(voice):
            return None  # a description of the voice, as Maya1 takes it
        return f"{self.title}: {self.voice_form()}; got {voice!r}"

    def voice_form(self) -> str:
        """The voices a request may name, in words."""
        names = list(self.voices) + [name for name, _ in self.described]
        shown = f"one of {names}" if names else ""
        if self.voice_pattern:
            shown = f"{shown} or " if shown else ""
            shown += f"an id of the form {self.voice_pattern!r} (e.g. {self.default_voice!r})"
        if self.described:
            shown += f", or a description of the voice (with spaces, up to {DESCRIPTION_LIMIT} characters, no < > \")"
        return shown

    def render(self, voice: str, text: str) -> str:
        """The prompt for ``text`` in ``voice`` (checked already)."""
        voice = dict(self.described).get(voice, voice)
        speaker = self.speaker.format(voice=voice) if voice else ""
        return self.prompt.format(speaker=speaker, text=text)

    def parse(self, prompt: str) -> tuple[str, str] | None:
        """(voice, text) of a prompt this preset renders, or None: what the stand-in LM checks."""
        speaker = re.escape(self.speaker).replace(re.escape("{voice}"), "(?P<voice>.+?)")
        optional = "?" if self.default_voice == "" else ""  # a voice may be left out (Kartoffel's "in_prompt")
        pattern = re.escape(self.prompt).replace(re.escape("{speaker}"), f"(?:{speaker}){optional}").replace(
            re.escape("{text}"), "(?P<text>.*)")
        found = re.fullmatch(pattern, prompt, re.DOTALL)
        return (found.group("voice") or "", found.group("text")) if found else None

    def sampling(self, temperature: float | None, top_p: float | None, repetition_penalty: float | None,
                 max_tokens: int | None) -> dict:
        """The request's sampling fields: the flags where given, else this preset's."""
        return {"max_tokens": self.max_tokens if max_tokens is None else max_tokens,
                "temperature": self.temperature if temperature is None else temperature,
                "top_p": self.top_p if top_p is None else top_p,
                "repetition_penalty": self.repetition_penalty if repetition_penalty is None else repetition_penalty,
                **self.extra}


def _orpheus_language(name: str, title: str, patterns: tuple[str, ...], voices: tuple[str, ...]) -> Preset:
    # canopylabs' multilingual research release: the English prompt, each language's own voices
    # (canopyai/Orpheus-TTS README, "Multilingual Family"; the voices as Lex-au/Orpheus-FastAPI lists them)
    return Preset(name, title, patterns, ORPHEUS_WRAP, "{voice}: ", voices, voices[0],
                  "canopyai/Orpheus-TTS README; Lex-au/Orpheus-FastAPI README (v1.3.0 voices)")


# svara-tts's voices (Kenpath/svara-tts-inference assets/voices/): v1 speaks as "Language (Gender)"
SVARA_V1_VOICES = tuple(f"{language} ({gender})" for language in (
    "Hindi", "Bengali", "Marathi", "Telugu", "Kannada", "Bhojpuri", "Magahi", "Chhattisgarhi", "Maithili", "Assamese",
    "Bodo", "Dogri", "Gujarati", "Malayalam", "Punjabi", "Tamil", "English (Indian)", "Nepali", "Sanskrit")
    for gender in ("Male", "Female"))
SVARA_V2_VOICES = (
    'Aaradhya', 'Abhiram', 'Aditya', 'Akshat', 'Akshay', 'Ananya', 'Anika', 'Anirudh', 'Anjali',
    'Ayesha', 'Bunty', 'Chanchal', 'Danish', 'Digpal', 'Hansika', 'Kanika', 'Karan', 'Karthik',
    'Kishan', 'Likhitha', 'Madhu', 'Maheshwari', 'Manav', 'Monica', 'Mumtaz', 'Prakash', 'Priya',
    'Rahul', 'Rajesh', 'Ranbir', 'Riya', 'Sagar', 'Samisha', 'Sapna', 'Shalini', 'Shashank',
    'Shivam', 'Shivani', 'Siddharth', 'Simran', 'Smrithi', 'Sneha', 'Tanvi', 'Tanya', 'Tripti',
    'Vasanth', 'Vidya', 'Viraj', 'Vishal', 'Yash',
)
SVARA_PROMPT = "<|begin_of_text|><custom_token_3><|audio|>{speaker}{text}<custom_token_4><|eot_id|><custom_token_5><custom_token_1>"
SVARA_SOURCE = "Kenpath/svara-tts-inference tts_engine/encoder.py, transports.py, assets/voices/"
SVARA_SAMPLING = {"temperature": 0.75, "top_p": 0.9, "repetition_penalty": 1.1, "max_tokens": 2048,
                  "extra": {"top_k": 40, "stop_token_ids": [END_OF_SPEECH]}}

# most specific first: the first preset with a pattern found in the LM's model name is chosen
PRESETS: dict[str, Preset] = {p.name: p for p in (
    # maya1: the model card's vLLM streaming script and chriswritescode-dev/maya1-fastapi
    # (hf_space/app.py build_prompt: Orpheus's wrapper around '<description="...">' and the text;
    # maya1/constants.py: stop 128258 alone, min_tokens 28, 0.4 / 0.9 / 1.1 / 2048, the 20 emotion
    # tags, OpenAI's voice names mapped to descriptions)
    Preset("maya1", "Maya1", (r"maya-?1",), ORPHEUS_WRAP, '<description="{voice}"> ', (), "alloy",
           "chriswritescode-dev/maya1-fastapi hf_space/app.py (build_prompt), maya1/constants.py",
           described=(("alloy", "Neutral voice with balanced tone and clear articulation"),
                      ("echo", "Male voice with slight echo and deep resonance"),
                      ("fable", "Storyteller voice with warm, engaging tone and expressive quality"),
                      ("onyx", "Deep male voice with authoritative tone and strong presence"),
                      ("nova", "Female voice with bright, energetic tone and clear pronunciation"),
                      ("shimmer", "Female voice with soft, gentle tone and smooth delivery")),
           tags=("<angry>", "<appalled>", "<chuckle>", "<cry>", "<curious>", "<disappointed>", "<excited>", "<exhale>",
                 "<gasp>", "<giggle>", "<gulp>", "<laugh>", "<laugh_harder>", "<mischievous>", "<sarcastic>",
                 "<scream>", "<sigh>", "<sing>", "<snort>", "<whisper>"),
           temperature=0.4, top_p=0.9, repetition_penalty=1.1, max_tokens=2048,
           extra={"stop_token_ids": [END_OF_SPEECH], "min_tokens": 28}),
    # Veena (maya-research/Veena): the table, and a public Gradio app of Veena's generate_speech
    # (the card itself not read): [start of human] + encode("<spk_NAME> text", add_special_tokens=False)
    # + [end of human, start of AI, start of speech], so no start of text; stop at end of speech or
    # end of AI; 0.4 / 0.9 / 1.05, max 700
    Preset("veena", "Veena", (r"veena",), "<custom_token_3>{speaker}{text}<custom_token_4><custom_token_5><custom_token_1>",
           "<spk_{voice}> ", ("kavya", "agastya", "maitri", "vinaya"), "kavya", "maya-research/Veena model card",
           tags=(), temperature=0.4, top_p=0.9, repetition_penalty=1.05, max_tokens=700,
           extra={"stop_token_ids": [END_OF_SPEECH, 128262], "add_special_tokens": False}),
    # svara-tts (Kenpath/svara-tts-inference at 822a9ac): tts_engine/encoder.py svara_text_to_tokens:
    # start of text, start of human, <|audio|> (156939), "speaker: text", end of human, <|eot_id|>,
    # start of AI, start of speech; tts_engine/transports.py: 0.75 / 0.9 / top_k 40 / 1.1 / 2048,
    # stop 128258; tts_engine/voice_config.py: a model named "v0.5" or "svara-tts-v2" takes v2's voices
    Preset("svara-v2", "svara-tts v2", (r"svara.*(v2|v0\.5)",), SVARA_PROMPT, "{voice}: ", SVARA_V2_VOICES, "Priya",
           SVARA_SOURCE, tags=(), **SVARA_SAMPLING),
    Preset("svara-v1", "svara-tts v1", (r"svara",), SVARA_PROMPT, "{voice}: ", SVARA_V1_VOICES, "Hindi (Female)",
           SVARA_SOURCE, tags=(), **SVARA_SAMPLING),
    # snorTTS-Indic-v0 (SaudxInu/indic-tts scripts/modal/snorTTS_Indic_v0_server.py): Orpheus's
    # wrapper around "{language}{speaker_id}: text", add_special_tokens false, stop 128258,
    # 0.4 / 0.9 / 1.05, max 2048 (less the prompt)
    Preset("snortts", "snorTTS-Indic-v0", (r"snor-?tts",), ORPHEUS_WRAP, "{voice}: ", (), "hindi159",
           "SaudxInu/indic-tts scripts/modal/snorTTS_Indic_v0_server.py", voice_pattern=r"[a-z]+[0-9]+",
           tags=(), temperature=0.4, top_p=0.9, repetition_penalty=1.05, max_tokens=2048,
           extra={"add_special_tokens": False, "stop_token_ids": [END_OF_SPEECH]}),
    # Kartoffel-Orpheus (SebastianBodza/Orpheus_Distributed_FastAPI streaming_api_server.py):
    # [128259] + tokenizer("voice: text") (its start of text included) + [128009, 128260]: the model
    # writes start of AI and start of speech itself; stop at the text "<custom_token_2>"; 0.6 / 0.95
    # / 1.1 / 4000; a voice is optional there ("in_prompt": the text alone)
    Preset("kartoffel", "Kartoffel-Orpheus (German)", (r"kartoffel",),
           "<custom_token_3><|begin_of_text|>{speaker}{text}<|eot_id|><custom_token_4>", "{voice}: ", (), "",
           "SebastianBodza/Orpheus_Distributed_FastAPI streaming_api_server.py", voice_pattern=SPEAKER_NAME,
           starts_speech=True, tags=(), temperature=0.6, top_p=0.95, repetition_penalty=1.1, max_tokens=4000,
           extra={"stop": ["<custom_token_2>"]}),
    # VyvoTTS (Vyvo-Labs/VyvoTTS at faf621a: inference/base.py _build_prompt_tokens, vllm_inference.py,
    # configs/inference/{lfm2,qwen3,llama3}.yaml): token ids [start of human] + tokenizer("voice: text")
    # (the base's start of text where its tokenizer adds one) + [end of text, end of human], sent as
    # ids (so no start of text added in front: add_special_tokens false); the model writes start of AI
    # and start of speech; stop at end of speech; 0.6 / 0.8 / 1.3 / 1200; a speaker prefix only where
    # given. Its audio tokens were added to each base's tokenizer as "<custom_token_N>" after the
    # base vocabulary (train/finetune/train.py), so their text is Orpheus's on any base: N - 10 is
    # the code plus its slot's offset; only the ids of the special tokens differ (end of speech: the
    # base's vocabulary size + 2). LFM2.5's VyvoTTS decodes with Mimi, not SNAC: no preset.
    *(Preset(name, f"VyvoTTS ({base})", (pattern,), prompt, "{voice}: ", (), "",
             "Vyvo-Labs/VyvoTTS vyvotts/inference/base.py, vllm_inference.py, configs/inference/" + config,
             voice_pattern=SPEAKER_NAME, starts_speech=True, tags=(), temperature=0.6, top_p=0.8,
             repetition_penalty=1.3, max_tokens=1200,
             extra={"stop_token_ids": [end_of_speech], "add_special_tokens": False, "skip_special_tokens": False})
      for name, base, pattern, prompt, config, end_of_speech in (
          ("vyvotts-qwen3", "Qwen3", r"vyvo.*qwen", "<custom_token_3>{speaker}{text}<|im_end|><custom_token_4>",
           "qwen3.yaml", 151671),
          ("vyvotts-llama3", "Llama 3", r"vyvo.*llama",
           "<custom_token_3><|begin_of_text|>{speaker}{text}<|eot_id|><custom_token_4>", "llama3.yaml", END_OF_SPEECH),
          ("vyvotts", "LFM2", r"vyvo", "<custom_token_3><|startoftext|>{speaker}{text}<|im_end|><custom_token_4>",
           "lfm2.yaml", 64402))),
    _orpheus_language("orpheus-fr", "Orpheus 3B French", (r"orpheus.*french", r"3b-fr\b"), ("pierre", "amelie", "marie")),
    _orpheus_language("orpheus-de", "Orpheus 3B German", (r"orpheus.*german", r"3b-de\b"), ("jana", "thomas", "max")),
    _orpheus_language("orpheus-ko", "Orpheus 3B Korean", (r"orpheus.*korean", r"3b-ko\b"), ("유나", "준서")),
    _orpheus_language("orpheus-hi", "Orpheus 3B Hindi", (r"orpheus.*hindi", r"3b-hi\b"), ("ऋतिका",)),
    _orpheus_language("orpheus-zh", "Orpheus 3B Mandarin", (r"orpheus.*(chinese|mandarin)", r"3b-zh\b"), ("长乐", "白芷")),
    _orpheus_language("orpheus-es-it", "Orpheus 3B Spanish and Italian", (r"orpheus.*(spanish|italian)", r"3b-(es|it)"),
                      ("javi", "sergio", "maria", "pietro", "giulia", "carlo")),
    # canopyai/Orpheus-TTS orpheus_tts_pypi/orpheus_tts/engine_class.py, _format_prompt ("larger"):
    # [128259] + tokenizer("voice: text") + [128009, 128260, 128261, 128257]; README: the eight
    # voices in order of realism, the eight emotive tags. Sampling: engine_class' 0.6 / 0.8 / 1.3;
    # max_tokens the server's 4096 (the package's 1200 cuts a 200-character segment of slow speech
    # short); no fields beside them: the request stays what every Orpheus server has taken
    Preset("orpheus", "Orpheus 3B (English)", (r"orpheus",), ORPHEUS_WRAP, "{voice}: ",
           ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"), "tara",
           "canopyai/Orpheus-TTS orpheus_tts_pypi/orpheus_tts/engine_class.py (_format_prompt)"),
)}


def choose_preset(model_name: str | None, named: str | None = None) -> tuple[Preset, str]:
    """The preset for an LM reporting ``model_name`` (``GET /models``), or the one ``named``
    (``--lm-preset``); and why, in one line for the start-up log. A name no preset matches gets
    Orpheus's, saying so."""
    if named is not None:
        if named not in PRESETS:
            raise ValueError(f"--lm-preset must be one of {', '.join(PRESETS)}, got {named!r}")
        return PRESETS[named], f"--lm-preset {named}"
    if not model_name:
        return PRESETS["orpheus"], "the LM reported no model name: the Orpheus preset"
    for preset in PRESETS.values():
        for pattern in preset.patterns:
            if re.search(pattern, model_name, re.IGNORECASE):
                return preset, f"the LM's model {model_name!r} matches {pattern!r}"
    return PRESETS["orpheus"], f"the LM's model {model_name!r} matches no preset: the Orpheus preset"


@dataclass(frozen=True)
class Voices:
    """The voices a server takes: its preset's, or ``--voices`` where given (names alone), with
    ``--voice`` (else the preset's default) when a request names none."""

    preset: Preset
    names: tuple[str, ...] | None
    default: str

    @classmethod
    def of(cls, preset: Preset, voices: str | None, voice: str | None) -> "Voices":
        names = tuple(v.strip() for v in voices.split(",") if v.strip()) if voices else None
        return cls(preset, names, voice if voice is not None else (names[0] if names else preset.default_voice))

    def problem(self, voice: str) -> str | None:
        """Why ``voice`` is not one a request may name (naming those it may), or None."""
        if self.names is not None:
            return None if voice in self.names else f"must be one of {list(self.names)}, got {voice!r}"
        problem = self.preset.voice_problem(voice)
        if problem is None:
            return None
        if self.preset.voices and not (self.preset.voice_pattern or self.preset.described):  # names alone
            return f"must be one of {list(self.preset.voices)} ({self.preset.title}'s voices), got {voice!r}"
        return f"must be a voice of {problem}"

    def listing(self) -> tuple[str, ...]:
        """The voices by name (``GET /v1/audio/voices``): a preset that takes ids or descriptions
        lists its default and its named ones."""
        if self.names is not None:
            return self.names
        named = self.preset.voices + tuple(name for name, _ in self.preset.described)
        return named or ((self.default,) if self.default else ())
