"""Text that arrives in pieces (a voice agent's LLM writing it), spoken into one engine stream.

Text is buffered until a sentence ends (or a flush); each sentence (cut at ``--segment-chars`` if
longer) is one LM request, and every request's ids go into the one stream
(:func:`snac_fast.serve.services.speech.speech_chunks`), so the audio runs on across sentences with no seam.
The text WebSockets (:mod:`snac_fast.serve.routes.text_stream`, :mod:`snac_fast.serve.routes.text_contexts`) hold
one of these per stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from snac_fast.serve.lm.segments import ended_sentences, split_text
from snac_fast.serve.services.formats import StreamEncoder, encoded
from snac_fast.serve.services.speech import speech_chunks


class TextBacklogError(ValueError):
    """More text waiting to be spoken than a stream may hold (``--max-input-chars``)."""


class SpokenText:
    """One stream (``sid``, already open) speaking text as it comes, in ``voice``; ``send`` gets the
    encoded audio (``encoder``'s bytes), in order, as it becomes final. :attr:`task` ends once
    :meth:`end` was called and everything queued is spoken (an LM or engine failure: its exception);
    the stream's slot is released however it ends (its owner still calls ``stream_ended``)."""

    def __init__(self, server, sid: int, voice: str, encoder: StreamEncoder,
                 send: Callable[[bytes], Awaitable[None]]) -> None:
        self.server, self.sid, self.voice, self.encoder, self._send = server, sid, voice, encoder, send
        self.buffer = ""  # text not spoken yet: its sentence has not ended
        # text buffered or queued and not yet asked of the LM, at most this much: 100 messages of
        # 1,000,000 characters without a sentence end, each rescanned, kept a server busy for a minute
        self.max_chars = server.settings.http.max_input_chars
        self._queued_chars = 0
        self.ended = False
        self.interrupted = False  # stopped by its client before all its text was spoken
        self._queued = self._flushed = 0  # segments queued so far; of them, up to the last flush
        self._texts: asyncio.Queue = asyncio.Queue()  # segments to speak, in order; None: no more
        self.task = asyncio.create_task(self._speak())

    @property
    def has_text(self) -> bool:
        """Whether any text came (spoken, queued or buffered)."""
        return bool(self._queued or self.buffer)

    def set_speed(self, speed: float) -> None:
        """Speak ``speed`` times as fast (FFmpeg's atempo, the pitch kept): before any text."""
        if self.has_text:
            raise ValueError("the speed is set before any text")
        if speed != self.encoder.speed:  # an opening message's voice_settings usually leave it at 1.0
            self.encoder = StreamEncoder(self.encoder.format, self.encoder.in_rate, self.encoder.rate, speed=speed)

    def add(self, text: str, flush: bool = False) -> None:
        """More text: its ended sentences queued to speak (with ``flush``, all of it)."""
        if self.ended:
            raise ValueError("text after the end")
        if len(self.buffer) + self._queued_chars + len(text) > self.max_chars:
            raise TextBacklogError(f"more than {self.max_chars} characters of text wait to be spoken "
                                   "(--max-input-chars): send less ahead of the audio, or end sentences")
        self.buffer += text
        done, self.buffer = (self.buffer, "") if flush else ended_sentences(self.buffer)
        self._queue(done)
        if flush:
            self._flushed = self._queued

    @property
    def all_flushed(self) -> bool:
        """Whether a flush came after all of its text (a turn's end, not a barge-in)."""
        return self._flushed == self._queued and not self.buffer.strip()

    def end(self, speak_rest: bool = True) -> None:
        """No more text: what is buffered is spoken too (``speak_rest``) or dropped."""
        if self.ended:
            return
        if speak_rest:
            self._queue(self.buffer)
        self.buffer, self.ended = "", True
        self._texts.put_nowait(None)

    def cancel(self) -> None:
        """Stop speaking now (a client gone); the slot is released."""
        self.ended = True
        self.task.cancel()

    def interrupt(self) -> None:
        """Stop speaking now at the client's word (a barge-in): no more audio, the slot released."""
        self.interrupted = True
        self.cancel()

    def _queue(self, text: str) -> None:
        for segment in split_text(text, self.server.settings.lm.segment_chars) if text.strip() else []:
            self._texts.put_nowait(segment)
            self._queued += 1
            self._queued_chars += len(segment)

    async def _sentences(self, text: str | None) -> AsyncIterator[str]:
        while text is not None:
            self._queued_chars -= len(text)
            yield text
            text = await self._texts.get()

    async def _speak(self) -> None:
        # the encoder is final once the first text came (set_speed may replace it before any)
        first = await self._texts.get()
        audio = speech_chunks(self.server, self.sid, self._sentences(first), self.voice, None,
                              on_first_ids=self.encoder.prepare)
        async for data in encoded(self.encoder, audio):
            await self._send(data)
