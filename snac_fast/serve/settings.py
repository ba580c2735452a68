"""What ``snac-fast serve`` takes, as one type: :class:`ServeSettings`.

Each option is a field with its default written here once; the ``serve`` command's flags are
generated from the fields (:func:`add_arguments`, :meth:`ServeSettings.from_arguments`), the
settings are checked in one place (:meth:`ServeSettings.check`), and they reach the worker
processes as one JSON document in one environment variable (:meth:`ServeSettings.to_json`) and the
engine process as the object itself (pickled by ``multiprocessing``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from snac_fast.configs import DEFAULT_MODEL

if TYPE_CHECKING:
    from snac_fast.orpheus import TokenLayout

DTYPES = ("float16", "bfloat16", "float32")
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


def _option(default: Any, help: str, *, flag: str | None = None, parse: Callable[[str], Any] | None = None,
            shown: str | None = None, choices: tuple | None = None, group: str = "server") -> Any:
    """A settings field that is also a ``serve`` flag: ``flag`` (default ``--field-name``), ``parse``
    for a flag whose text is not the value's type, ``shown`` for the default in ``--help``."""
    meta = {"help": help, "flag": flag, "parse": parse, "shown": shown, "choices": choices, "group": group}
    return field(default=default, metadata=meta)


@dataclass
class ServeSettings:
    """Every setting of a speech server: the model, the engine's batching, the LM, the HTTP server.
    Defaults are the ``serve`` command's. :meth:`check` raises ValueError naming a bad value."""

    # the model
    model: str = _option(DEFAULT_MODEL, "hub id, local folder, or synthetic:<name>", group="model")
    device: str | None = _option(None, "cuda, cuda:1, cpu (default: cuda if available; several workers "
                                 "without it take the host's GPUs in turn)", group="model")
    dtype: str | None = _option(None, "compute dtype (default: float16 on cuda, float32 on cpu)",
                                choices=DTYPES, group="model")
    local_files_only: bool = _option(False, "never touch the network; use the hub cache", group="model")
    cpu_threads: int = _option(0, "with --device cpu: torch threads per worker (0: the host's cores shared among "
                               "the workers)", group="model")
    # the engine and its batcher
    max_streams: int = _option(256, "concurrent streams per worker (per engine with --shared-engine)",
                               group="engine")
    max_batch: int = _option(256, "streams per engine call", group="engine")
    max_wait_ms: float = _option(60.0, "while pushes keep coming, engine calls start at most this often (or once "
                                 "--max-batch pushes wait), never holding a stream's first audio: fuller, fewer "
                                 "calls, so an LM on the same GPU loses few steps (0: whatever is pending when the "
                                 "engine is free; docs/http_server.md)", group="engine")
    gpu_memory_gb: float = _option(0.0, "GPU memory the engine's process may hold, its CUDA context included, as "
                                   "vLLM's share beside it: the step graphs are sized to fit (fewer streams per "
                                   "engine call), or the start fails saying what does not (0: no budget)",
                                   group="engine")
    idle_timeout_s: float = _option(60.0, "seconds before an idle stream is released", flag="--idle-timeout",
                                    group="engine")
    lookahead: int | str | None = _option(None, "streams' lookahead: 'exact' (the receptive field), 'fp16' "
                                          "(the least closer to float32 than an fp16 decode), or samples below "
                                          "the exact: earlier first audio, approximate (docs/streaming.md)",
                                          parse=parse_lookahead, shown="exact", group="engine")
    engine_thread: bool = _option(False, "run the engine calls on a thread of their own instead of the "
                                  "event loop (docs/batching.md)", group="engine")
    # the language model
    lm_url: str | None = _option(None, "the LM server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1",
                                 group="lm")
    lm_model: str | None = _option(None, "model name of the LM's completions requests (default: the "
                                   "request's 'model')", group="lm")
    voice: str = _option("tara", "voice when a request names none", group="lm")
    voices: str = _option("tara,leah,jess,leo,dan,mia,zac,zoe", "the voices requests may name (comma-separated; "
                          "GET /v1/audio/voices lists them): the Orpheus fine-tunes'", group="lm")
    max_tokens: int = _option(4096, "most tokens an LM request may generate", group="lm")
    temperature: float = _option(0.6, "the LM's sampling temperature", group="lm")
    top_p: float = _option(0.8, "the LM's nucleus sampling", group="lm")
    repetition_penalty: float = _option(1.3, "the LM's repetition penalty", group="lm")
    lm_timeout_s: float = _option(60.0, "seconds to connect to the LM, and of silence from it, before a "
                                  "request fails", flag="--lm-timeout", group="lm")
    # the HTTP server
    host: str = _option("127.0.0.1", "address to listen on")
    port: int = _option(8880, "port to listen on (1-65535)")
    workers: int = _option(1, "worker processes, each with its own engine unless --shared-engine")
    shared_engine: bool = _option(False, "one engine process on the device that every worker feeds: all "
                                  "connections in one batch (--max-streams is then the engine's)")
    engine_event_loop: bool = _option(False, "with --shared-engine: the engine process reads, decodes and "
                                      "answers on one asyncio event loop instead of threads (docs/batching.md)")
    api_key: str | None = _option(None, f"require 'Authorization: Bearer KEY' (or 'xi-api-key: KEY') on every endpoint "
                                  f"but /health and the page; several keys comma-separated (default: "
                                  f"${API_KEY_VARIABLE}, else none)", shown="none")
    allow_origins: str = _option("", "web origins (scheme://host:port, comma-separated; '*': any) whose pages may "
                                 "call this server and open its WebSockets (CORS); a browser request from any other "
                                 "origin gets a 403 (default: none but this server's own page)")
    # limits of a public endpoint (docs/http_server.md, "Limits")
    max_body_bytes: int = _option(262144, "largest request body in bytes (413 past it)", group="limits")
    max_streams_per_key: int = _option(0, "open streams at most per API key (per client address without a key; "
                                       "0: no limit; 429 past it)", group="limits")
    max_ws_message_bytes: int = _option(1 << 20, "largest WebSocket message in bytes (the socket closes 1009 past it)",
                                        group="limits")
    max_ws_messages_per_s: float = _option(200.0, "WebSocket messages a second per connection, sustained (twice as "
                                           "many in a burst; the socket closes 1008 past it)", group="limits")
    ws_idle_timeout_s: float = _option(60.0, "seconds an ids WebSocket may send nothing before it is closed",
                                       flag="--ws-idle-timeout", group="limits")
    header_timeout_s: float = _option(10.0, "seconds a connection may take to send its request's headers, and "
                                      "again its body (a slow client is dropped; a slow body gets a 408)",
                                      flag="--header-timeout", group="limits")
    max_input_chars: int = _option(20000, "longest speech 'input' in characters (~20 minutes of speech; OpenAI's "
                                   "own limit is 4,096)")
    segment_chars: int = _option(200, "a longer 'input' is spoken as segments of at most this many characters cut "
                                 "at sentence ends, one LM request each, into one stream (Orpheus LMs stop after "
                                 "~14 s of speech)", group="lm")
    # not a flag: the LM's token layout (Orpheus's), for servers built in Python on another layout
    layout: TokenLayout = field(default_factory=lambda: _orpheus(), metadata={"flag": None, "group": None})

    def check(self) -> "ServeSettings":
        """Raise ValueError naming the first bad value; returns the settings."""
        for name in ("max_streams", "max_batch", "workers", "max_tokens", "max_input_chars", "segment_chars",
                     "max_body_bytes", "max_ws_message_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.cpu_threads < 0:
            raise ValueError(f"--cpu-threads must be >= 0, got {self.cpu_threads}")
        if self.max_streams_per_key < 0:
            raise ValueError(f"--max-streams-per-key must be >= 0, got {self.max_streams_per_key}")
        for name in ("idle_timeout_s", "lm_timeout_s", "max_ws_messages_per_s", "ws_idle_timeout_s", "header_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{_flag(name)} must be > 0, got {getattr(self, name):g}")
        if self.gpu_memory_gb < 0:
            raise ValueError(f"--gpu-memory-gb must be >= 0, got {self.gpu_memory_gb:g}")
        if self.max_wait_ms < 0:
            raise ValueError(f"--max-wait-ms must be >= 0, got {self.max_wait_ms:g}")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be 1-65535, got {self.port}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.engine_event_loop and not self.shared_engine:
            raise ValueError("--engine-event-loop is a setting of the shared engine process: add --shared-engine")
        if self.lm_url is not None and not self.lm_url.startswith(("http://", "https://")):
            raise ValueError(f"--lm-url must be an http(s) URL, got {self.lm_url!r}")
        if isinstance(self.lookahead, int) and self.lookahead < 0:
            raise ValueError(f"--lookahead must be >= 0 samples, got {self.lookahead}")
        if not self.voice_names:
            raise ValueError("--voices must name at least one voice")
        if self.voice not in self.voice_names:
            raise ValueError(f"--voice {self.voice!r} is not one of --voices {','.join(self.voice_names)}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")
        if self.device is not None:
            import torch  # the CLI names a bad device in one line, before any model loads

            try:
                torch.device(self.device)
            except (RuntimeError, TypeError):
                raise ValueError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}") from None
        return self

    @property
    def voice_names(self) -> tuple[str, ...]:
        return tuple(v.strip() for v in self.voices.split(",") if v.strip())

    def threads_per_worker(self) -> int:
        """A CPU worker's torch threads: --cpu-threads, else the cores this process may run on over the workers."""
        return self.cpu_threads or max(1, len(os.sched_getaffinity(0)) // self.workers)

    @property
    def warmup_streams(self) -> int:
        """Streams a CUDA engine's warm-up captures step graphs for: one engine call's worth."""
        return min(self.max_batch, self.max_streams)

    # -- the hand-off to worker processes ------------------------------------------------------

    def to_json(self) -> str:
        """The settings as JSON (every field but ``layout``, which must be Orpheus's: workers rebuild it)."""
        if self.layout != _orpheus():
            raise ValueError("only the Orpheus token layout travels to worker processes; build the app in Python "
                             "(snac_fast.serve.create_app) to serve another")
        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "layout"})

    @classmethod
    def from_json(cls, text: str) -> "ServeSettings":
        return cls(**json.loads(text))

    # -- the command line ----------------------------------------------------------------------

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> "ServeSettings":
        """The settings from the flags :func:`add_arguments` made (checked)."""
        values = {}
        for f in _flag_fields():
            text = getattr(args, f.name)
            values[f.name] = f.metadata["parse"](text) if f.metadata["parse"] and isinstance(text, str) else text
        if values["api_key"] is None:
            values["api_key"] = os.environ.get(API_KEY_VARIABLE) or None
        return cls(**values).check()


def _orpheus() -> "TokenLayout":
    from snac_fast.orpheus import (
        ORPHEUS,  # numpy and torch: not imported to build the CLI's flags
    )

    return ORPHEUS


_GROUPS = {"model": "model", "engine": "engine and batching", "lm": "language model", "server": "HTTP server",
           "limits": "limits of a public endpoint"}


def _flag_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(ServeSettings) if f.metadata.get("group")]


def _flag(name: str) -> str:
    meta = ServeSettings.__dataclass_fields__[name].metadata
    return meta.get("flag") or "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per :class:`ServeSettings` field to ``parser``, grouped, each with its default."""
    groups = {key: parser.add_argument_group(title) for key, title in _GROUPS.items()}
    for f in _flag_fields():
        meta, flag = f.metadata, _flag(f.name)
        group = groups[meta["group"]]
        if f.type in ("bool", bool):
            group.add_argument(flag, dest=f.name, action="store_true", default=f.default, help=meta["help"])
            continue
        shown = meta["shown"] if meta["shown"] is not None else f.default
        kind = {"int": int, "float": float}.get(f.type.split(" ")[0]) if meta["parse"] is None else str
        text = meta["help"] if "(default:" in meta["help"] else f"{meta['help']} (default: {shown})"
        group.add_argument(flag, dest=f.name, type=kind, default=f.default if meta["parse"] is None else shown,
                           choices=meta["choices"], metavar=flag[2:].upper().replace("-", "_"), help=text)
