"""A front-end's connection to the engine process (:mod:`snac_fast.serve.engine.process`): the
calls of :class:`~snac_fast.serve.AsyncStreamBatcher`, sent once per turn of the event loop.

A front-end frames its streams' token ids itself (numpy, :class:`~snac_fast.orpheus.TokenFramer`: a
bad id fails here, before anything is sent) and sends, once per turn of its event loop, one message
holding every push queued in that turn (:func:`~snac_fast.serve.engine.wire.push_message`); a
thread reads the replies and resolves each request's future on the loop.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import threading
from multiprocessing.connection import Client

import numpy as np

from snac_fast.orpheus import ORPHEUS, TokenLayout
from snac_fast.serve.engine.wire import (
    AUDIO,
    ERRORS,
    OPS,
    TAG,
    push_message,
    read_audio,
)
from snac_fast.batching.futures import resolve


class EngineLostError(RuntimeError):
    """The engine process went away (it exited or was killed): every request of its front-ends fails
    with this, at once, until the server is restarted."""


class EngineClient:
    """A front-end's connection to an :class:`EngineProcess`, for asyncio (make and use it in one
    event loop). The same calls as :class:`~snac_fast.serve.AsyncStreamBatcher` (``open`` is
    awaited: the engine process hands out the stream). A cancelled ``await`` releases its stream."""

    def __init__(self, address: str, layout: TokenLayout = ORPHEUS) -> None:
        self.layout = layout
        self._conn = Client(address, family="AF_UNIX")
        self._loop = asyncio.get_running_loop()
        self._futures: dict[int, asyncio.Future] = {}
        self._framers: dict = {}
        self._next = 0
        self._outbox: list = []
        self._pushes: list[tuple[int, int, int, np.ndarray]] = []  # (req, sid, frames, row)
        self._closed = False
        self.lost: EngineLostError | None = None  # set once the engine process has gone away
        self._reader = threading.Thread(target=self._read, name="snac-fast-engine-client", daemon=True)
        self._reader.start()

    # -- calls ---------------------------------------------------------------------------------

    async def open(self, seed: int | None = None) -> int:
        sid = await self._request(lambda req: ("open", req, seed))
        self._framers[sid] = self.layout.framer()
        return sid

    async def push_ids(self, stream_id: int, ids) -> np.ndarray:
        """Raw LM token ids (checked here); the stream's audio that became final (numpy PCM)."""
        framer = self._framer(stream_id)
        if self.lost is not None:  # before the framer takes the ids: nothing will decode them
            raise self.lost
        frames, row = framer.push_row(ids)
        if not frames:
            return np.empty(0, np.int16)
        req = self._new_request()
        self._pushes.append((req, stream_id, frames, row))
        self._schedule()
        return await self._awaited(stream_id, req)

    async def flush(self, stream_id: int, *, drop_incomplete_frame: bool = False) -> np.ndarray:
        """End the stream: the rest of its audio (``drop_incomplete_frame``: as AsyncStreamBatcher's)."""
        framer = self._framer(stream_id)
        framer.drop_incomplete() if drop_incomplete_frame else framer.finish()
        del self._framers[stream_id]
        return await self._request(lambda req: ("flush", req, stream_id), stream_id)

    def is_open(self, stream_id: int) -> bool:
        """Whether this client's stream takes pushes (not flushed nor released here)."""
        return stream_id in self._framers

    @property
    def open_streams(self) -> int:
        """This client's open streams."""
        return len(self._framers)

    def release(self, stream_id: int) -> None:
        """Drop a stream without the rest of its audio (safe twice)."""
        if self._framers.pop(stream_id, None) is not None and self.lost is None:
            self._outbox.append(("release", stream_id))
            self._schedule()

    async def stats(self) -> dict:
        """The engine process's counters: open streams, engine calls, requests, failed calls, and
        seconds of its engine thread in engine calls and of CUDA-event time they spanned."""
        return await self._request(lambda req: ("stats", req))

    def close(self) -> None:
        """Disconnect: the engine process releases this front-end's streams."""
        if not self._closed:
            self._closed = True
            try:  # shut the socket down first: the reader thread blocked in recv() holds it open otherwise
                with socket.socket(fileno=os.dup(self._conn.fileno())) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._conn.close()

    # -- plumbing ------------------------------------------------------------------------------

    def _framer(self, stream_id: int):
        framer = self._framers.get(stream_id)
        if framer is None:
            raise ValueError(f"no open stream {stream_id!r} on this client")
        return framer

    def _new_request(self) -> int:
        if self.lost is not None:
            raise self.lost
        req, self._next = self._next, self._next + 1
        self._futures[req] = self._loop.create_future()
        return req

    async def _request(self, op, stream_id: int | None = None):
        req = self._new_request()
        self._outbox.append(op(req))
        self._schedule()
        return await self._awaited(stream_id, req)

    async def _awaited(self, stream_id: int | None, req: int):
        try:
            return await self._futures[req]
        except asyncio.CancelledError:
            if stream_id is not None:
                self.release(stream_id)
            raise
        finally:
            self._futures.pop(req, None)

    def _schedule(self) -> None:
        """Send what this turn of the event loop queued, once, at its end."""
        if len(self._outbox) + len(self._pushes) == 1:
            self._loop.call_soon(self._send)

    def _send(self) -> None:
        ops, self._outbox = self._outbox, []
        pushes, self._pushes = self._pushes, []
        if self._closed or self.lost is not None:
            return
        by_frames: dict[int, list] = {}
        for push in pushes:
            by_frames.setdefault(push[2], []).append(push)
        try:
            for frames, group in by_frames.items():
                self._conn.send_bytes(push_message([p[0] for p in group], [p[1] for p in group], frames,
                                                    [p[3] for p in group]))
            if ops:
                self._conn.send_bytes(OPS + pickle.dumps(ops, pickle.HIGHEST_PROTOCOL))
        except OSError:  # the engine process is gone (its socket closed before the reader saw it)
            self._lost()

    def _read(self) -> None:
        try:
            while True:
                data = self._conn.recv_bytes()
                message = [read_audio(data)] if data[:TAG] == AUDIO else pickle.loads(data)
                self._loop.call_soon_threadsafe(self._answer, message)
        except (EOFError, OSError):
            if not self._closed:
                self._loop.call_soon_threadsafe(self._lost)
        except RuntimeError:  # the loop closed
            pass

    def _answer(self, message: list) -> None:
        for item in message:
            kind = item[0]
            if kind == "audio":
                _, reqs, offsets, pcm = item
                for j, req in enumerate(reqs.tolist()):
                    self._resolve(req, pcm[offsets[j]:offsets[j + 1]])
            elif kind == "error":
                _, req, name, text = item
                self._resolve(req, ERRORS.get(name, RuntimeError)(text))
            else:  # opened, stats
                self._resolve(item[1], item[2])

    def _resolve(self, req: int, value) -> None:
        resolve(self._futures.get(req), value)

    def _lost(self) -> None:
        """The engine process went away: what waits fails, and every later request at once."""
        if self.lost is None:
            self.lost = EngineLostError("the engine process went away (it exited or was killed); "
                                        "restart the server")
        for req in list(self._futures):
            self._resolve(req, self.lost)
