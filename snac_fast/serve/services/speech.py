"""Speaking text into one engine stream: the LM's audio ids for each segment of a text (or for texts
as they arrive), pushed into the stream as they complete frames, its audio out as it becomes final.
OpenAI's and ElevenLabs' routes, and the text WebSockets (:mod:`snac_fast.serve.services.spoken_text`),
all speak through :func:`speech_chunks`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field

import numpy as np

from snac_fast.serve.lm.client import REQUEST_MARKS, LMOutputError
from snac_fast.serve.lm.segments import split_text

# the most frames one push holds, so that a stream behind its LM catches up a few frames an engine
# round without making the round long for every other stream: with 4, 4 text WebSockets on the
# 2-core CPU stalled as with one frame a push (one stream of 4, 5-129 ms), with 8 all four (505 ms),
# unbounded 1.4 s (a 23-frame push held the round ~450 ms)
PUSH_FRAMES = 4


@dataclass
class FirstAudioTimes:
    """When one speech request reached each step to its first audio (``time.perf_counter()``), sent
    to the client as a ``Server-Timing`` header (:meth:`header`) with the first audio."""

    received: float  # the route began (the body read)
    lm_asked: float | None = None  # the LM request went out
    lm_marks: dict[str, float] = field(default_factory=dict)  # the LM client's: connected, sent (REQUEST_MARKS)
    lm_first_ids: float | None = None  # the LM's first audio ids arrived
    frames_ready: float | None = None  # the LM chunk completing the first decodable frames arrived
    audio: float | None = None  # the engine returned the first audio
    encoded: float | None = None  # the format's first bytes were ready

    def header(self) -> str:
        """``Server-Timing``: ``setup`` (to the LM request), ``lm_first`` (to the LM's first ids),
        ``lm`` (to the chunk completing the first decodable frames), ``engine``, ``encode``, ``total``;
        ``lm_connect`` and ``lm_send`` (to the LM request's connection taken or made, to its headers
        written); and three clock marks, ``lm_asked_at``, ``lm_sent_at`` and ``frames_ready_at`` (ms on
        the host's monotonic clock, which ``time.perf_counter`` reads on Linux), with which a harness on
        the same host splits ``lm`` into the request's way to the LM (the server's part to
        ``lm_sent_at``, then the LM's accept) and the answer's way back."""
        connected, sent = self.lm_marks.get("connected"), self.lm_marks.get("sent")
        marks = [("setup", self.received, self.lm_asked), ("lm_connect", self.lm_asked, connected),
                 ("lm_send", self.lm_asked, sent), ("lm_first", self.lm_asked, self.lm_first_ids),
                 ("lm", self.lm_asked, self.frames_ready), ("engine", self.frames_ready, self.audio),
                 ("encode", self.audio, self.encoded), ("total", self.received, self.encoded),
                 ("lm_asked_at", 0.0, self.lm_asked), ("lm_sent_at", 0.0, sent),
                 ("frames_ready_at", 0.0, self.frames_ready)]
        return ", ".join(f"{name};dur={(end - start) * 1e3:.2f}" for name, start, end in marks
                         if start is not None and end is not None)


async def segment_ids(lm, texts: AsyncIterable[str], voice: str, model: str | None
                      ) -> AsyncIterator[tuple[int, list[int]]]:
    """(segment index, audio ids) of the LM's answer to each text of ``texts``, in order, as texts
    keep arriving (a text WebSocket's sentences) or all known (a long input's segments). Segment
    k+1's request goes out once segment k's first ids have arrived (or k ended) and its text is
    known, so its first tokens are ready when k ends: two requests at most in flight, and the first
    one alone until it speaks. An LM error surfaces where its segment's ids would have."""
    known: list[str] = []
    queues: list[asyncio.Queue] = []
    tasks: list[asyncio.Task] = []
    at = {"segment": 0, "spoke": False}
    arrived = asyncio.Event()

    async def fill(text: str, queue: asyncio.Queue) -> None:
        try:
            async for ids in lm.ids(text, voice, model):
                queue.put_nowait(ids)
            queue.put_nowait(None)
        except Exception as e:  # noqa: BLE001 (handed to the reader, in order)
            queue.put_nowait(e)

    def start_allowed() -> None:
        last = at["segment"] + at["spoke"]  # segment k, and k+1 once k has spoken
        while len(tasks) <= last and len(tasks) < len(known):
            queues.append(asyncio.Queue())
            tasks.append(asyncio.create_task(fill(known[len(tasks)], queues[-1])))

    async def read() -> None:
        try:
            async for text in texts:
                known.append(text)
                start_allowed()
                arrived.set()
        finally:  # the task is done when its waiter next runs
            arrived.set()
    reader = asyncio.create_task(read())
    try:
        while True:
            k = at["segment"]
            while len(queues) <= k:  # segment k's text has not come yet
                if reader.done():
                    if reader.exception() is not None:
                        raise reader.exception()
                    return
                arrived.clear()
                await arrived.wait()
            ended = False
            while not ended:
                # everything the LM sent meanwhile in one piece: a stream behind its LM (a later segment's
                # ids queued while the one before still spoke) catches up PUSH_FRAMES frames a push, not
                # one LM chunk of 1-4 tokens an engine round, which held text WebSockets' audio seconds
                # behind their LM
                items = [await queues[k].get()]
                while isinstance(items[-1], list) and not queues[k].empty():
                    items.append(queues[k].get_nowait())
                ids = [i for item in items if isinstance(item, list) for i in item]
                if ids:
                    if not at["spoke"]:
                        at["spoke"] = True
                        start_allowed()
                    yield k, ids
                if isinstance(items[-1], Exception):
                    raise items[-1]
                ended = items[-1] is None
            at["segment"], at["spoke"] = k + 1, False
            start_allowed()
    finally:
        for task in (reader, *tasks):
            task.cancel()


async def _listed(texts: list[str]) -> AsyncIterator[str]:
    for text in texts:
        yield text


async def speech_chunks(server, sid: int, text: str | AsyncIterable[str], voice: str, model: str | None,
                        times: FirstAudioTimes | None = None,
                        on_first_ids: Callable[[], object] | None = None) -> AsyncIterator[np.ndarray]:
    """float32 audio of one stream's speech as it becomes final; the stream is released on any exit.
    ``text``: a text, spoken a segment at a time when longer than ``--segment-chars``
    (:mod:`snac_fast.serve.lm.segments`), or texts as they arrive; all of them into this one stream.
    ``times``: marked on the way to the first audio. ``on_first_ids``: called when the LM's first
    ids arrive, for the work the first audio will need (the encoder opened): the LM request is out
    by then, and the LM has the rest of the first frames to make."""
    times = times or FirstAudioTimes(time.perf_counter())
    finished = False
    frame_size = server.settings.layout.frame_size
    texts = _listed(split_text(text, server.settings.lm.segment_chars)) if isinstance(text, str) else text

    async def push(ids: list[int]) -> np.ndarray:
        try:
            return await server.push(sid, ids)
        except ValueError as e:
            if not server.backend.is_open(sid):  # released meanwhile: idle past idle_timeout_s, say
                raise LMOutputError(f"the stream ended while the language model was still sending: {e}") from None
            raise LMOutputError(f"the language model sent a token that is not audio: {e}") from None

    async def whole_frames(ids: list[int]) -> AsyncIterator[np.ndarray]:
        """The audio of whole frames' ids, at most :data:`PUSH_FRAMES` frames a push: a stream behind
        its LM catches up a few frames a round, its audio out after each, and the rounds the other
        streams share stay short. Where one of them is not audio, the frames before it a push each, so
        that their audio goes out before the error (a push is checked whole before it runs)."""
        most = PUSH_FRAMES * frame_size
        for start in range(0, len(ids), most):
            piece = ids[start:start + most]
            try:
                yield await push(piece)
                continue
            except LMOutputError:
                if len(piece) <= frame_size or not server.backend.is_open(sid):
                    raise
            for at in range(0, len(piece), frame_size):
                yield await push(piece[at:at + frame_size])

    try:
        first = True
        held: list[int] = []  # ids of a frame not yet whole: only whole frames are pushed
        segment = 0
        times.lm_asked = time.perf_counter()
        REQUEST_MARKS.set(times.lm_marks)  # the LM requests' tasks, made below, mark it
        async for k, ids in segment_ids(server.lm, texts, voice, model):
            if times.lm_first_ids is None:
                times.lm_first_ids = time.perf_counter()
                if on_first_ids is not None:
                    on_first_ids()
            if k != segment:  # a join: an LM that stopped mid-frame leaves a piece of a frame, dropped
                segment, held = k, []
            held += ids
            whole = len(held) - len(held) % frame_size
            if not whole:
                continue
            started = time.perf_counter()
            async with contextlib.aclosing(whole_frames(held[:whole])) as pieces:
                async for audio in pieces:
                    if audio.size:
                        if first:
                            times.frames_ready, times.audio = started, time.perf_counter()
                            server.metrics.first_audio.observe(times.audio - started)
                            first = False
                        yield audio
            held = held[whole:]
        if held:  # an incomplete last frame: its ids are checked, then dropped by the flush
            await push(held)
        finished = True
        audio = await server.backend.flush(sid, drop_incomplete_frame=True)
        if audio.size:
            yield audio
        server.metrics.outcome("speech", "done")
    finally:  # an error, or the client went away: free the slot now
        server.stream_ended(sid, release=not finished)
