"""The language model's side of ``snac-fast serve``: an OpenAI-compatible completions stream
(vLLM, SGLang, llama.cpp, LM Studio) asked for speech in the Orpheus prompt format, and its
server-sent events turned into audio token ids as they arrive."""

from __future__ import annotations

import asyncio
import codecs
import contextvars
import functools
import json
import re
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

from snac_fast.orpheus import CUSTOM_TOKEN_ID, END_OF_SPEECH, START_OF_SPEECH, TokenLayout
from snac_fast.serve.lm.presets import PRESETS, Preset
from snac_fast.serve.settings import LMSettings

CUSTOM_TOKEN = re.compile(r"<custom_token_(\d+)>")
KEEPALIVE_S = 4.0  # how long an idle LM connection stays pooled (LMClient._client)
MAX_TOKEN_DIGITS = 9  # a <custom_token_N>'s N (Orpheus's reach 28,682): more digits is junk, not a number to parse
# where a speech's first LM request got to (``time.perf_counter()``): "connected" (a pooled connection
# taken or a new one made) and "sent" (its headers written), each the first of the speech's requests.
# A context variable, so that the request's task (a child of the speech's, sharing the dict) marks
# it without the LM's interface carrying it: it splits the request's way to the LM into the server's
# part and the LM's accept (FirstAudioTimes)
REQUEST_MARKS: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("lm_request_marks", default=None)


async def _mark(name: str, session, context, params) -> None:
    marks = REQUEST_MARKS.get()
    if marks is not None and name not in marks:
        marks[name] = time.perf_counter()


def redacted_url(url: str) -> str:
    """``url`` as it may be shown (health, errors, logs): no user or password, no query, no fragment
    (``http://user:password@host/v1?key=k`` -> ``http://host/v1``)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        return "<an unparsable URL>"
    host = f"[{host}]" if ":" in host else host
    return urlunsplit((parts.scheme, host + port, parts.path, "", ""))

class LMOutputError(Exception):
    """The language model's stream could not be turned into audio (a malformed token, an error)."""


class LMBusyError(LMOutputError):
    """The language model answered 429 or 503 (overloaded): worth a retry, after ``retry_after`` s
    when it said (its Retry-After header in seconds), else None."""

    def __init__(self, message: str, retry_after: str | None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class _AudioClock:
    """``--lm-timeout`` counted between audio tokens, not bytes: an LM that keeps its connection
    alive with SSE comments or empty events, and sends no audio, fails after that long."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.last = time.monotonic()

    def heard(self) -> None:
        self.last = time.monotonic()

    async def watch(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            if time.monotonic() - self.last > self.timeout_s:
                raise LMOutputError(f"the language model sent no audio token for {self.timeout_s:g} s (--lm-timeout)")
            yield chunk


class LMClient:
    """Streams audio token ids from an OpenAI-compatible completions API (``config.lm_url``), one
    HTTP connection per stream, on aiohttp: its C parsers read an SSE chunk for about a third of
    httpx's host time (docs/http_server.md, "The LM client"), and a server reads one chunk per stream
    every ~30 ms."""

    def __init__(self, config: LMSettings, layout: TokenLayout, max_connections: int,
                 preset: Preset | None = None) -> None:
        self.config, self.layout, self.max_connections = config, layout, max_connections
        self.preset = preset or PRESETS[config.lm_preset or "orpheus"]  # the server sets the one it found
        self._session = None
        self._aiohttp = None
        if config.lm_url is not None:  # imported now: importing it at the first request delayed its audio
            import aiohttp

            self._aiohttp = aiohttp

    def _client(self):
        """The session, made in the event loop that uses it (aiohttp binds a session to its loop)."""
        if self._session is None:
            aiohttp = self._aiohttp
            # one connection per stream: a smaller pool would queue the streams past it behind whole
            # answers. One timeout for connecting too: a loaded host's event loop can take seconds to
            # see a local connect complete (CI timed out 1 of 32 at 5 s); a dead LM refuses at once
            # keepalive_timeout under the 5 s that uvicorn-served LMs (vLLM, SGLang) keep an idle
            # connection: a pooled connection is dropped here before the LM closes it
            connector = aiohttp.TCPConnector(limit=self.max_connections + 8, keepalive_timeout=KEEPALIVE_S)
            timeout = aiohttp.ClientTimeout(total=None, connect=self.config.lm_timeout_s,
                                            sock_read=self.config.lm_timeout_s)
            trace = aiohttp.TraceConfig()
            trace.on_connection_reuseconn.append(functools.partial(_mark, "connected"))
            trace.on_connection_create_end.append(functools.partial(_mark, "connected"))
            trace.on_request_headers_sent.append(functools.partial(_mark, "sent"))
            # trust_env: HTTP(S)_PROXY and NO_PROXY apply, as for any HTTP client a user configures
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=True,
                                                  trace_configs=[trace])
        return self._session

    async def ids(self, text: str, voice: str, model: str | None) -> AsyncIterator[list[int]]:
        """The LM's audio token ids for a prompt, as they stream in (control tokens dropped; the end
        of speech ends it). LMOutputError for anything that is not a completions stream, and for an
        LM that cannot be reached or stops answering."""
        if self._aiohttp is None:
            raise LMOutputError("this server has no language model: start it with --lm-url")
        preset, config = self.preset, self.config
        body = {"model": config.lm_model or model, "prompt": preset.render(voice, text),
                **preset.sampling(config.temperature, config.top_p, config.repetition_penalty, config.max_tokens),
                "stream": True}
        url = self.config.lm_url.rstrip("/") + "/completions"
        shown = redacted_url(url)
        aiohttp = self._aiohttp
        for attempt in range(2):
            answered = False
            try:
                async with self._client().post(url, json=body) as response:
                    answered = True
                    if response.status != 200:
                        detail = (await response.read()).decode(errors="replace")[:200]
                        message = f"the language model at {shown} answered {response.status}: {detail}"
                        if response.status in (429, 503):
                            retry_after = response.headers.get("Retry-After")
                            raise LMBusyError(message, retry_after if retry_after and retry_after.isdigit() else None)
                        raise LMOutputError(message)
                    left = most = body["max_tokens"]  # enforced here too: an LM that never stops is cut there
                    clock = _AudioClock(self.config.lm_timeout_s)
                    chunks = clock.watch(response.content.iter_any())
                    async for ids in _ids_of_events(_sse_data(chunks), self.layout.offset, preset.starts_speech):
                        clock.heard()
                        ids = ids[:left]
                        left -= len(ids)
                        yield ids
                        if left <= 0:
                            return
                    if left == most:
                        raise LMOutputError(f"the language model at {shown} answered without audio tokens "
                                            f"(a {response.content_type or 'untyped'} answer, not a stream of completions)")
                return
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                # a pooled connection the LM closed as the request went out (its keep-alive ended, or
                # a busy loop saw the close late): nothing was answered, so once more on a new one
                stale = isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)) and \
                    not isinstance(e, aiohttp.ClientConnectorError)
                if stale and not answered and attempt == 0:
                    continue
                raise LMOutputError(f"the language model at {shown} failed: {type(e).__name__}: "
                                    f"{str(e).replace(url, shown)}") from None

    async def warm_up(self) -> None:
        """Before the first request: the session made, and one completions event parsed (JSON, the
        token pattern), so that no request's first audio waits for their first use."""
        if self._aiohttp is not None:
            self._client()
            codecs.lookup("idna")  # aiohttp loads it for the LM's host name at the first request

        async def events():
            yield b'data: {"choices": [{"text": "<custom_token_10>"}]}\n\ndata: [DONE]\n\n'

        async for _ in _ids_of_events(_sse_data(events()), self.layout.offset):
            pass

    async def model_name(self, timeout_s: float = 5.0) -> str | None:
        """The first model id the LM lists (``GET {lm_url}/models``), or None when it lists none or
        does not answer: what the server finds its preset from."""
        if self._aiohttp is None:
            return None
        url = self.config.lm_url.rstrip("/") + "/models"
        try:
            async with self._client().get(url, timeout=self._aiohttp.ClientTimeout(total=timeout_s)) as response:
                if response.status != 200:
                    return None
                data = json.loads(await response.read()).get("data") or []
                name = data[0].get("id") if isinstance(data[0], dict) else None
                return name if isinstance(name, str) else None
        except (self._aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, AttributeError, IndexError):
            return None

    async def probe(self, timeout_s: float = 2.0) -> tuple[str, str | None]:
        """Whether the LM answers: ("ok", None), ("unreachable", why) or ("not_configured", None).
        A GET of its ``/models`` (every OpenAI-compatible server has it); any answer under 500 counts."""
        if self._aiohttp is None:
            return "not_configured", None
        url = self.config.lm_url.rstrip("/") + "/models"
        shown = redacted_url(url)
        try:
            async with self._client().get(url, timeout=self._aiohttp.ClientTimeout(total=timeout_s)) as response:
                if response.status < 500:
                    return "ok", None
                return "unreachable", f"{shown} answered {response.status}"
        except (self._aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            return "unreachable", f"{shown}: {type(e).__name__}: {str(e).replace(url, shown)}"[:300]

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


async def _ids_of_events(batches: AsyncIterator[list[str]], offset: int, after_start_of_speech: bool = False
                         ) -> AsyncIterator[list[int]]:
    """Audio token ids (>= ``offset``; with ``after_start_of_speech``, those after the start of
    speech the LM writes itself) from a completions stream's ``data:`` fields, one list per
    batch of fields that completes any (all the events that had arrived when it was read: a stream
    whose consumer fell behind takes all it missed in one list, and so pushes all its whole frames
    at once instead of one a round); ends at ``[DONE]`` or the end of speech. LMOutputError for a
    chunk that is not a completion."""
    tail = ""  # text after the last whole token: a token can be cut between two chunks
    speaking = not after_start_of_speech
    async for batch in batches:
        ids, end = [], False
        for data in batch:
            if data == "[DONE]":
                end = True
                break
            try:
                text_piece = json.loads(data)["choices"][0].get("text") or ""
                if not isinstance(text_piece, str):
                    raise TypeError
            except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError):
                if ids:  # the good ids before it first: their audio goes out before the error
                    yield ids
                raise LMOutputError(f"the language model sent a chunk that is not a completion: {data[:120]!r}") from None
            tail += text_piece
            cut = 0
            for match in CUSTOM_TOKEN.finditer(tail):
                cut = match.end()
                if len(match.group(1)) > MAX_TOKEN_DIGITS:
                    if ids:
                        yield ids
                    raise LMOutputError(f"the language model sent a token number of {len(match.group(1))} digits")
                token = CUSTOM_TOKEN_ID + int(match.group(1))
                if token == END_OF_SPEECH:
                    end = True
                    break
                if token == START_OF_SPEECH:
                    speaking = True
                elif token >= offset and speaking:
                    ids.append(token)
            if end:
                break
            tail = tail[cut:]
            start = tail.rfind("<")
            tail = tail[start:] if start >= 0 and len(tail) - start < 32 else ""  # keep only a token's beginning
        if ids:
            yield ids
        if end:
            return


async def _sse_data(chunks: AsyncIterator[bytes]) -> AsyncIterator[list[str]]:
    """The ``data:`` fields of a server-sent-event stream, read from raw bytes as they arrive: a list
    of those each read completed (text and line decoders cost a fifth of the event loop at 256
    streams)."""
    buffer = b""
    async for raw in chunks:
        buffer += raw
        *lines, buffer = buffer.split(b"\n")
        try:
            fields = [line[5:].strip().decode() for line in lines if line.startswith(b"data:")]
        except UnicodeDecodeError:  # the good fields before it first: their audio goes out before the error
            fields = []
            for line in lines:
                if line.startswith(b"data:"):
                    try:
                        fields.append(line[5:].strip().decode())
                    except UnicodeDecodeError:
                        if fields:
                            yield fields
                        raise _not_utf8(line) from None
        if fields:
            yield fields
    if buffer.startswith(b"data:"):
        try:
            yield [buffer[5:].strip().decode()]
        except UnicodeDecodeError:
            raise _not_utf8(buffer) from None


def _not_utf8(line: bytes) -> LMOutputError:
    return LMOutputError(f"the language model sent bytes that are not UTF-8: {line[:60]!r}")
