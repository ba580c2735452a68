"""What ``snac-fast serve`` takes: :class:`ServeSettings`, composed of one settings type per layer,
:class:`EngineSettings` (the codec and its stream engine: all the engine process is handed),
:class:`LMSettings` (the language model) and :class:`HTTPSettings` (the server and its limits).

Each option is a field with its default written here once (the batcher's call size and wait come
from :mod:`snac_fast.batching.defaults`); the ``serve`` command's flags are generated from the
fields (:func:`add_arguments`, :meth:`ServeSettings.from_arguments`), each part checks its own
values (``check``), and the settings reach the worker processes as one JSON document in one
environment variable (:meth:`ServeSettings.to_json`) and the engine process as its part alone.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from snac_fast import options
from snac_fast.batching.defaults import ROWS_PER_PASS, SERVER_MAX_BATCH, SERVER_MAX_WAIT_MS
from snac_fast.configs import DEFAULT_MODEL
from snac_fast.options import option, part
from snac_fast.runtime.host_memory import TRIM_SLACK_BYTES
from snac_fast.serve.lm.presets import PRESETS, Preset, Voices

if TYPE_CHECKING:
    from snac_fast.orpheus import TokenLayout

DTYPES = ("float16", "bfloat16", "float32")
ENGINE_CALLS = ("auto", "loop", "thread")
API_KEY_VARIABLE = "SNAC_FAST_API_KEY"  # the key, kept off the command line (where ps shows it)


def parse_lookahead(text: str) -> int | str | None:
    """``--lookahead``'s text as :class:`~snac_fast.streaming.StreamEngine` takes it: ``exact`` ->
    None, ``fp16`` -> "fp16", else a number of samples >= 0."""
    if text in ("exact", "fp16"):
        return None if text == "exact" else text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"--lookahead must be 'exact', 'fp16' or a number of samples >= 0, got {text!r}")
    return value


def _at_least(settings: Any, names: tuple[str, ...], low: float, strict: bool = False) -> None:
    """ValueError naming the first of ``names`` below ``low`` (at or below, when ``strict``)."""
    for name in names:
        value = getattr(settings, name)
        if value < low or (strict and value == low):
            sign = ">" if strict else ">="
            raise ValueError(f"{options.flag_of(type(settings), name)} must be {sign} {low:g}, got {value:g}")


@dataclass
class EngineSettings:
    """The codec and its stream engine: the model to load, the stream slots, the engine calls'
    size and wait, and who runs them. All an engine reads, in a worker or in the engine process."""

    model: str = option(DEFAULT_MODEL, "hub id, local folder, or synthetic:<name>")
    device: str | None = option(None, "cuda, cuda:1, cpu (default: cuda if available; several workers without it "
                                "take the host's GPUs in turn)")
    dtype: str | None = option(None, "compute dtype (default: float16 on cuda, float32 on cpu)", choices=DTYPES)
    local_files_only: bool = option(False, "never touch the network; use the hub cache")
    cpu_threads: int = option(0, "with --device cpu: torch threads per worker (0: the host's cores shared among the "
                              "workers)")
    max_streams: int = option(256, "concurrent streams per worker (per engine with --shared-engine)")
    max_batch: int = option(SERVER_MAX_BATCH, "streams per engine call, and the largest call the warm-up captures")
    rows_per_pass: int = option(ROWS_PER_PASS, "a step of more streams runs the decoder on slices of at most this many in "
                                "turn, inside its one CUDA graph: the step graphs' memory is a slice's, for a little "
                                "more GPU time (H100, 256 streams: 0.63 GB less, +6%%); the audio is the same "
                                "(0: the whole step at once)")
    max_wait_ms: float = option(SERVER_MAX_WAIT_MS, "while pushes keep coming, engine calls start at most this often "
                                "(or once --max-batch pushes wait), never holding a stream's first audio: fuller, "
                                "fewer calls, so an LM on the same GPU loses few steps (0: whatever is pending when "
                                "the engine is free; docs/http_server.md)")
    gpu_memory_gb: float = option(0.0, "GPU memory the engine's process may hold, its CUDA context included, as "
                                  "vLLM's share beside it: the step graphs are sized to fit (fewer streams per engine "
                                  "call), or the start fails saying what does not (0: no budget)")
    memory_trim_s: float = option(5.0, "seconds between checks of the process's heap: freed memory goes back to the OS "
                                  f"(glibc's malloc_trim) when the heap lies over {TRIM_SLACK_BYTES >> 20} MB above its "
                                  "working level, the reading after the last hand-back (0: never)", flag="--memory-trim")
    idle_timeout_s: float = option(60.0, "seconds before an idle stream is released", flag="--idle-timeout")
    lookahead: int | str | None = option(None, "streams' lookahead: 'exact' (the receptive field), 'fp16' (the least "
                                         "closer to float32 than an fp16 decode), or samples below the exact: "
                                         "earlier first audio, approximate (docs/streaming.md)",
                                         parse=parse_lookahead, shown="exact")
    engine_calls: str = option("auto", "who runs the engine's calls: 'loop' (the event loop, between its other "
                               "callbacks), 'thread' (threads of their own), 'auto' (the loop in a worker's own "
                               "engine, threads in the --shared-engine process: each the faster there; "
                               "docs/batching.md)", choices=ENGINE_CALLS,
                               aliases={"--engine-thread": "thread", "--engine-event-loop": "loop"})

    def check(self) -> "EngineSettings":
        """Raise ValueError naming the first bad value; returns the settings."""
        _at_least(self, ("max_streams", "max_batch"), 1)
        _at_least(self, ("cpu_threads", "gpu_memory_gb", "max_wait_ms", "rows_per_pass"), 0)
        _at_least(self, ("idle_timeout_s",), 0, strict=True)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.engine_calls not in ENGINE_CALLS:
            raise ValueError(f"--engine-calls must be one of {', '.join(ENGINE_CALLS)}, got {self.engine_calls!r}")
        if isinstance(self.lookahead, int) and self.lookahead < 0:
            raise ValueError(f"--lookahead must be >= 0 samples, got {self.lookahead}")
        if self.device is not None:
            import torch  # the CLI names a bad device in one line, before any model loads

            try:
                torch.device(self.device)
            except (RuntimeError, TypeError):
                raise ValueError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}") from None
        return self

    def load_codec(self, device: str | None = None, **model_options: Any):
        """The model, loaded (:func:`snac_fast.api.load_codec`) on ``device`` (default: :attr:`device`)."""
        from snac_fast.api import load_codec

        return load_codec(self.model, device=device or self.device, dtype=self.dtype,
                          local_files_only=self.local_files_only, **model_options)

    def calls_on_loop(self, engine_process: bool) -> bool:
        """Whether an event loop runs the engine's calls: in the engine process (``engine_process``)
        or in a worker's own engine."""
        return self.engine_calls == "loop" or (self.engine_calls == "auto" and not engine_process)

    @property
    def warmup_streams(self) -> int:
        """Streams a CUDA engine's warm-up captures step graphs for: one engine call's worth."""
        return min(self.max_batch, self.max_streams)


@dataclass
class LMSettings:
    """The language model behind an OpenAI-compatible completions API: where, which family of
    model (its prompt, voices, stop and sampling: :mod:`snac_fast.serve.lm.presets`), how it
    samples where the preset's defaults are overridden, how long text is cut for it."""

    lm_url: str | None = option(None, "the LM server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    lm_model: str | None = option(None, "model name of the LM's completions requests (default: the request's "
                                  "'model')")
    lm_preset: str | None = option(None, "the LM's family, which sets its prompt, voices, stop and sampling (default: "
                                   "found from the model name GET {lm_url}/models reports; Orpheus's when none "
                                   f"matches): {', '.join(PRESETS)}", choices=tuple(PRESETS))
    voice: str | None = option(None, "voice when a request names none (default: the preset's)")
    voices: str | None = option(None, "the voices requests may name, comma-separated (default: the preset's; GET "
                                "/v1/audio/voices lists them)")
    max_tokens: int | None = option(None, "most tokens an LM request may generate (default: the preset's)")
    temperature: float | None = option(None, "the LM's sampling temperature (default: the preset's)")
    top_p: float | None = option(None, "the LM's nucleus sampling (default: the preset's)")
    repetition_penalty: float | None = option(None, "the LM's repetition penalty (default: the preset's)")
    lm_timeout_s: float = option(60.0, "seconds to connect to the LM, and of silence from it, before a request "
                                 "fails", flag="--lm-timeout")
    segment_chars: int = option(200, "a longer 'input' is spoken as segments of at most this many characters cut at "
                                "sentence ends, one LM request each, into one stream (Orpheus LMs stop after ~14 s "
                                "of speech)")

    def check(self) -> "LMSettings":
        """Raise ValueError naming the first bad value; returns the settings."""
        _at_least(self, ("segment_chars",), 1)
        if self.max_tokens is not None:
            _at_least(self, ("max_tokens",), 1)
        _at_least(self, ("lm_timeout_s",), 0, strict=True)
        if self.lm_url is not None and not self.lm_url.startswith(("http://", "https://")):
            raise ValueError(f"--lm-url must be an http(s) URL, got {self.lm_url!r}")
        if self.lm_preset is not None and self.lm_preset not in PRESETS:
            raise ValueError(f"--lm-preset must be one of {', '.join(PRESETS)}, got {self.lm_preset!r}")
        if self.voices is not None and not self.voices.replace(",", "").strip():
            raise ValueError("--voices must name at least one voice")
        if self.lm_preset is not None or self.voices is not None:  # the voice can be checked now
            self.check_voice(PRESETS[self.lm_preset or "orpheus"])
        return self

    def voices_of(self, preset: Preset) -> Voices:
        """The voices a server of these settings takes with ``preset``."""
        return Voices.of(preset, self.voices, self.voice)

    def check_voice(self, preset: Preset) -> None:
        """ValueError when ``--voice`` is not a voice of ``preset`` (or of ``--voices``)."""
        voices = self.voices_of(preset)
        problem = voices.problem(voices.default)
        if problem is not None:
            where = "--voices" if self.voices is not None else f"the {preset.name} preset"
            raise ValueError(f"--voice {voices.default!r} is not one of {where}'s voices: {problem}")


@dataclass
class HTTPSettings:
    """The HTTP server: where it listens, its processes, its keys and origins, the limits of a
    public endpoint (docs/http_server.md, "Limits")."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8880, "port to listen on (1-65535)")
    workers: int = option(1, "worker processes, each with its own engine unless --shared-engine")
    shared_engine: bool = option(False, "one engine process on the device that every worker feeds: all connections "
                                 "in one batch (--max-streams is then the engine's)")
    api_key: str | None = option(None, f"require 'Authorization: Bearer KEY' (or 'xi-api-key: KEY') on every endpoint "
                                 f"but /health and the page; several keys comma-separated (default: "
                                 f"${API_KEY_VARIABLE}, else none)", shown="none")
    allow_origins: str = option("", "web origins (scheme://host:port, comma-separated; '*': any) whose pages may call "
                                "this server and open its WebSockets (CORS); a browser request from any other origin "
                                "gets a 403 (default: none but this server's own page)")
    max_body_bytes: int = option(262144, "largest request body in bytes (413 past it)")
    max_streams_per_key: int = option(0, "open streams at most per API key (per client address without a key; 0: no "
                                      "limit; 429 past it)")
    max_ws_message_bytes: int = option(1 << 20, "largest WebSocket message in bytes (the socket closes 1009 past it)")
    max_ws_messages_per_s: float = option(200.0, "WebSocket messages a second per connection, sustained (twice as "
                                          "many in a burst; the socket closes 1008 past it)")
    ws_idle_timeout_s: float = option(60.0, "seconds an ids WebSocket may send nothing before it is closed",
                                      flag="--ws-idle-timeout")
    header_timeout_s: float = option(10.0, "seconds a connection may take to send its request's headers, and again "
                                     "its body (a slow client is dropped; a slow body gets a 408)",
                                     flag="--header-timeout")
    keep_alive_s: float = option(75.0, "seconds an idle keep-alive connection stays open: longer than clients keep "
                                 "theirs (httpx 5 s, aiohttp 15 s), so that a request never meets the server closing "
                                 "its connection (uvicorn's own 5 s raced httpx's)", flag="--keep-alive-timeout")
    max_input_chars: int = option(20000, "longest speech 'input' in characters (~20 minutes of speech; OpenAI's own "
                                  "limit is 4,096)")
    ws_compression: bool = option(False, "accept a WebSocket client's offer of per-message compression "
                                  "(permessage-deflate; declined by default): base64 audio a quarter smaller for "
                                  "~1 ms of a worker's CPU per 9 KB message (docs/http_server.md, \"Voice agents\")")

    def check(self) -> "HTTPSettings":
        """Raise ValueError naming the first bad value; returns the settings."""
        _at_least(self, ("workers", "max_input_chars", "max_body_bytes", "max_ws_message_bytes"), 1)
        _at_least(self, ("max_streams_per_key",), 0)
        _at_least(self, ("max_ws_messages_per_s", "ws_idle_timeout_s", "header_timeout_s", "keep_alive_s"), 0, strict=True)
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be 1-65535, got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")
        return self


@dataclass
class ServeSettings:
    """Every setting of a speech server, a part per layer: ``engine``, ``lm``, ``http``. Defaults
    are the ``serve`` command's. :meth:`check` raises ValueError naming a bad value;
    :meth:`of` builds one from the options' names alone."""

    engine: EngineSettings = part(EngineSettings, "model, engine and batching")
    lm: LMSettings = part(LMSettings, "language model")
    http: HTTPSettings = part(HTTPSettings, "HTTP server and the limits of a public endpoint")
    # not a flag: the LM's token layout (Orpheus's), for servers built in Python on another layout
    layout: TokenLayout = field(default_factory=lambda: _orpheus())

    @classmethod
    def of(cls, **values: Any) -> "ServeSettings":
        """Settings from options named alone (``ServeSettings.of(max_streams=64, lm_url=URL)``), each
        given to the part that has it; TypeError naming one that none has."""
        kinds = options.parts_of(cls)
        parts = {name: {} for name in kinds}
        layout = values.pop("layout", None)
        for name, value in values.items():
            owner = next((p for p, kind in kinds.items() if name in kind.__dataclass_fields__), None)
            if owner is None:
                raise TypeError(f"ServeSettings has no option {name!r}")
            parts[owner][name] = value
        made = cls(**{p: kinds[p](**v) for p, v in parts.items()})
        if layout is not None:
            made.layout = layout
        return made

    def check(self) -> "ServeSettings":
        """Raise ValueError naming the first bad value; returns the settings."""
        self.engine.check(), self.lm.check(), self.http.check()
        return self

    def threads_per_worker(self) -> int:
        """A CPU worker's torch threads: --cpu-threads, else the cores this process may run on over the workers."""
        return self.engine.cpu_threads or max(1, len(os.sched_getaffinity(0)) // self.http.workers)

    # -- the hand-off to worker processes ------------------------------------------------------

    def to_json(self) -> str:
        """The settings as JSON (every option; not ``layout``, which must be Orpheus's: workers rebuild it)."""
        if self.layout != _orpheus():
            raise ValueError("only the Orpheus token layout travels to worker processes; build the app in Python "
                             "(snac_fast.serve.create_app) to serve another")
        return json.dumps(options.to_dict(self))

    @classmethod
    def from_json(cls, text: str) -> "ServeSettings":
        return options.from_dict(cls, json.loads(text))

    # -- the command line ----------------------------------------------------------------------

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> "ServeSettings":
        """The settings from the flags :func:`add_arguments` made (checked)."""
        settings = options.from_arguments(cls, args)
        if settings.http.api_key is None:
            settings.http.api_key = os.environ.get(API_KEY_VARIABLE) or None
        return settings.check()


def _orpheus() -> "TokenLayout":
    from snac_fast.orpheus import (
        ORPHEUS,  # numpy and torch: not imported to build the CLI's flags
    )

    return ORPHEUS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per option of :class:`ServeSettings`' parts to ``parser``, grouped, each with its default."""
    options.add_arguments(parser, ServeSettings)
