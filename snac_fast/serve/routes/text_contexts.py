"""``WS /v1/text-to-speech/{voice_id}/multi-stream-input``: ElevenLabs' multi-context text WebSocket
(their API reference, "Multi-Context WebSocket", and their Python SDK's ``*Multi`` message types),
the one Pipecat's ``ElevenLabsTTSService`` and LiveKit's ElevenLabs plugin speak: point their base
URL here.

A connection holds up to :data:`MAX_CONTEXTS` contexts at once, each one engine stream speaking
its text as :class:`~snac_fast.serve.services.spoken_text.SpokenText` does (sentences buffered until they
end or a flush, one LM request each, the audio seamless across them). Messages (``context_id``,
or ``contextId``; none: the default context):

- ``{"text": " ", "context_id"}`` opens a context (its ``voice_settings.speed`` honoured as
  OpenAI's ``speed``; the rest of ``voice_settings`` and ``generation_config`` accepted and unused);
  any text for an id not open opens one too;
- ``{"text": "...", "context_id", "flush"?}`` adds text; ``{"context_id", "flush": true}`` speaks
  what is buffered now;
- ``{"text": "", "context_id"}`` keeps a context alive (``{"text": ""}`` alone, the connection);
- ``{"context_id", "close_context": true}``: no more text. If a flush came after all of the
  context's text (a turn's end: Pipecat and LiveKit flush, then close), it is all spoken first;
  else (a barge-in) the speaking stops at once, the LM's request with it. Then
  ``{"isFinal": true, "contextId"}``; the id may be used again for a new context;
- ``{"close_socket": true}``: every context's text is spoken (flushed), each ends with its
  ``isFinal``, and the server closes 1000.

Audio replies are ``{"audio", "isFinal": null, "normalizedAlignment": null, "alignment": null,
"contextId"}``. A context with no message for ``inactivity_timeout`` seconds (default 20) is closed:
its ended sentences spoken, the rest dropped, then its isFinal; a connection with no context and no
message for as long closes 1008. A sixth open context closes the connection 1008
(``max_active_conversations``), as theirs does; an LM or engine failure closes it 1011 after an
error naming the context; a failure of the server's own on a message closes it 1011
(``internal_error``, logged). The query's ``output_format``
and ``inactivity_timeout`` are honoured; ``model_id``, ``auto_mode``, ``sync_alignment``,
``language_code`` and the rest are accepted and unused (docs/http_server.md).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from snac_fast.serve.access.limits import MessageRate, TooManyStreams, client_of
from snac_fast.serve.engine.client import EngineLostError
from snac_fast.serve.lm.client import LMOutputError
from snac_fast.serve.routes.elevenlabs_protocol import (
    audio_message,
    close_with_error,
    connection_problem,
    error_kind,
    error_message,
    json_object,
    voice_speed,
)
from snac_fast.serve.routes.protocol import checked_text
from snac_fast.serve.services.formats import StreamEncoder
from snac_fast.serve.services.spoken_text import SpokenText, TextBacklogError

MAX_CONTEXTS = 5  # open contexts per connection: ElevenLabs' limit
MAX_CONTEXT_ID_CHARS = 256
DONE = ("done", None, None, None)  # a connection's outcome: (metric, error name, message, close code)
CLOSED = ("closed", None, None, None)
FAILED = ("internal_error", "internal_error", "the server failed on a message (its log says why)", 1011)
log = logging.getLogger("snac_fast.serve")


async def multi_stream_input(websocket) -> None:
    """The route."""
    problem, fmt, timeout = connection_problem(websocket)
    await websocket.accept()
    if problem:
        await close_with_error(websocket, problem, "invalid_request", 1008)
        return
    await _Connection(websocket, fmt, timeout).serve()


class _Connection:
    """One client's contexts: text in, each context's audio out, until ``close_socket``, the client
    goes, or an error."""

    def __init__(self, websocket, fmt, timeout: float) -> None:
        self.ws, self.fmt, self.timeout = websocket, fmt, timeout
        self.server = websocket.app.state.server
        self.voice, self.client = websocket.path_params["voice_id"], client_of(websocket.scope)
        self.open: dict[str | None, SpokenText] = {}  # contexts taking text
        self.last_message: dict[str | None, float] = {}
        self.watchers: set[asyncio.Task] = set()  # one per context still speaking, open or closed
        self.closing = False  # close_socket received
        self.heard = time.monotonic()
        self._send_lock = asyncio.Lock()
        self._outcome: asyncio.Future = asyncio.get_running_loop().create_future()

    async def serve(self) -> None:
        tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._expire())]
        try:
            metric, error, message, code = outcome = await self._outcome
            if outcome == DONE:
                await self.ws.close(code=1000)
            elif error is not None:
                await close_with_error(self.ws, message, error, code)
            self.server.metrics.outcome("text_contexts", metric)
        except (RuntimeError, OSError):  # gone meanwhile
            self.server.metrics.outcome("text_contexts", "closed")
        finally:
            for task in tasks:
                task.cancel()
            for text in self.open.values():
                text.cancel()
            for watcher in list(self.watchers):
                watcher.cancel()
            await asyncio.gather(*tasks, *self.watchers, return_exceptions=True)

    def _end(self, outcome: tuple) -> None:
        if not self._outcome.done():
            self._outcome.set_result(outcome)

    async def _send(self, message: dict) -> None:
        async with self._send_lock:  # the contexts' speakers send concurrently
            await self.ws.send_json(message)

    async def _receive(self) -> None:
        from starlette.websockets import WebSocketDisconnect

        rate = MessageRate(self.server.settings.http.max_ws_messages_per_s)
        try:
            while not self.closing:
                raw = await self.ws.receive()
                if raw["type"] == "websocket.disconnect":
                    self._end(CLOSED)
                    return
                self.heard = time.monotonic()
                if not rate.allow():
                    self._end(("rate_limited", "rate_limited", "more messages than --max-ws-messages-per-s", 1008))
                    return
                message = _message(raw.get("text"))
                if isinstance(message, str):
                    await self._send(error_message(message, "invalid_message", 1008))
                    continue
                await self._handle(message)
        except (WebSocketDisconnect, RuntimeError, OSError):
            self._end(CLOSED)
        except Exception:  # noqa: BLE001 - a bug of ours: the connection ends (its contexts' slots freed), not hangs
            log.exception("multi-stream-input: a message failed")
            self._end(FAILED)

    async def _handle(self, message: dict) -> None:
        if message.get("close_socket"):
            self.closing = True
            for text in self.open.values():
                text.end()  # every context flushed: its text spoken, then its isFinal
            self.open.clear()
            self.last_message.clear()
            if not self.watchers:
                self._end(DONE)
            return
        cid = message.get("context_id", message.get("contextId"))
        text = self.open.get(cid)
        if message.get("close_context"):
            if text is None:
                await self._send(error_message(f"no open context {cid!r} to close", "invalid_message", 1008,
                                               contextId=cid))
                return
            self._close(cid)
            return
        if text is None:
            if not message.get("text"):  # a keep-alive or a flush of nothing: nothing to open a context for
                return
            try:
                speed = voice_speed(message.get("voice_settings"))
            except ValueError as e:
                await self._send(error_message(str(e), "invalid_message", 1008, contextId=cid))
                return
            text = await self._open(cid, speed)
            if text is None:
                return
        self.last_message[cid] = time.monotonic()
        try:
            text.add(message.get("text") or "", flush=bool(message.get("flush")))
        except TextBacklogError as e:  # the context stops speaking (its slot freed first); the connection's others go on
            del self.last_message[cid], self.open[cid]
            text.interrupt()
            await self._send(error_message(str(e), "text_backlog_exceeded", 1008, contextId=cid))

    def _close(self, cid: str | None, by_client: bool = True) -> None:
        """No more text for the context, then its isFinal. Closed by its client: if a flush came
        after all of its text (a turn's end), all of it is spoken first, else (a barge-in) the
        speaking stops now. Closed for silence: its ended sentences are spoken, the rest dropped."""
        del self.last_message[cid]
        text = self.open.pop(cid)
        if text.all_flushed or not by_client:
            text.end(speak_rest=False)
        else:
            text.interrupt()

    async def _open(self, cid: str | None, speed: float) -> SpokenText | None:
        """A new context's stream and speaker, or None once the connection is ending (why: its outcome)."""
        if len(self.open) >= MAX_CONTEXTS:
            self._end(("max_active_conversations", "max_active_conversations",
                       f"Maximum simultaneous contexts per WebSocket connection exceeded ({MAX_CONTEXTS}). "
                       "Please close an existing context before opening a new one.", 1008))
            return None
        try:
            sid = await self.server.open_stream(None, self.client)
        except EngineLostError as e:
            self._end(("engine_unavailable", "engine_unavailable", str(e), 1011))
            return None
        except TooManyStreams as e:
            self._end(("too_many_streams", "too_many_streams", str(e), 1008))
            return None
        if sid is None:
            self._end(("server_busy", "server_busy", "all stream slots are in use; retry shortly", 1013))
            return None
        encoder = StreamEncoder(self.fmt, self.server.backend.rate, self.fmt.rate, speed=speed)
        text = SpokenText(self.server, sid, self.voice, encoder, functools.partial(self._send_audio, cid))
        self.open[cid] = text
        watcher = asyncio.create_task(self._watch(cid, text))
        self.watchers.add(watcher)
        # the context's end goes in the watcher's done callback, not a finally of its own: a watcher
        # cancelled before its first step (the connection ending right after this open) runs no
        # finally, and a flood's last context held its slot for good
        watcher.add_done_callback(lambda task: self._context_over(text, task))
        return text

    async def _send_audio(self, cid: str | None, data: bytes) -> None:
        await self._send(audio_message(data, contextId=cid))

    async def _watch(self, cid: str | None, text: SpokenText) -> None:
        """A context's end: its isFinal once all its audio is out, or the connection's error."""
        from starlette.websockets import WebSocketDisconnect

        try:
            await asyncio.wait([text.task])
            if text.task.cancelled() and not text.interrupted:  # the connection is ending
                return
            e = None if text.task.cancelled() else text.task.exception()
            if isinstance(e, (LMOutputError, RuntimeError)):  # the LM failed, or the engine
                self._end((error_kind(e), error_kind(e), f"context {cid!r}: {e}", 1011))
            elif e is not None:  # the client went away while audio was sent
                self._end(CLOSED)
            else:
                await self._send({"isFinal": True, "contextId": cid})
        except (WebSocketDisconnect, RuntimeError, OSError):  # gone before its isFinal
            self._end(CLOSED)

    def _context_over(self, text: SpokenText, watcher: asyncio.Task) -> None:
        """A context's end (its watcher's done callback, so once): its speaker stopped, its slot
        back, its watcher gone."""
        self.watchers.discard(watcher)
        text.cancel()
        self.server.stream_ended(text.sid, release=True)
        if self.closing and not self.watchers:
            self._end(DONE)

    async def _expire(self) -> None:
        """Contexts silent for ``inactivity_timeout`` closed; a connection with none and silent as long, ended."""
        while True:
            await asyncio.sleep(min(1.0, self.timeout / 4))
            now = time.monotonic()
            for cid in [cid for cid in self.open if now - self.last_message[cid] > self.timeout]:
                self._close(cid, by_client=False)
            if not self.open and not self.watchers and now - self.heard > self.timeout:
                self._end(("timed_out", "input_timeout_exceeded",
                           f"no message for {self.timeout:g} s (inactivity_timeout)", 1008))
                return


def _message(raw: str | None) -> dict | str:
    """A message, or what is wrong with it (a binary one among them)."""
    message = json_object(raw)
    if message is None:
        return ('messages must be JSON objects: {"text": "...", "context_id": "..."} (and "flush": true), '
                '{"context_id": "...", "close_context": true}, {"close_socket": true}')
    if not any(k in message for k in ("text", "flush", "close_context", "close_socket")):
        return f"a message needs 'text', 'flush', 'close_context' or 'close_socket'; got keys {sorted(message)[:8]}"
    if "text" in message and not isinstance(message["text"], str):
        return "'text' must be a string"
    if "text" in message and (problem := checked_text(message["text"], "text")):
        return problem
    cid = message.get("context_id", message.get("contextId"))
    if cid is not None and (not isinstance(cid, str) or not 0 < len(cid) <= MAX_CONTEXT_ID_CHARS):
        return f"'context_id' must be a string of 1-{MAX_CONTEXT_ID_CHARS} characters"
    return message
