"""One stream engine process per GPU, fed by front-end processes (docs/serving.md, "Past one process").

One process serving thousands of streams is bound by its interpreter (the event loop and the
engine thread share one GIL), and one engine per worker process makes the GPU time-slice between
the processes' contexts. Here the engine has a process of its own: :class:`EngineProcess` starts
it (the model, the shared stream engine, a :class:`~snac_fast.serving.StreamBatcher`'s engine
thread and its rounds), and each front-end process (an HTTP worker, say) talks to it through an
:class:`EngineClient` over a Unix socket (``multiprocessing.connection``). A front-end frames its
streams' token ids itself (numpy, :class:`~snac_fast.orpheus.TokenFramer`: a bad id fails there,
before anything is sent) and sends, once per turn of its event loop, one message holding every
push queued in that turn as raw int64 arrays (request numbers, stream ids, one level-major row per
push; no pickle to take apart). In the engine process one thread reads every front-end and queues
each message's pushes as one block, the engine thread runs the blocks as row slices of its engine
calls and answers each call with one message per front-end (PCM of its pushes end to end and their
offsets, cut from the call's PCM; raw arrays too, not a pickle), so no step of the engine process
is per push, and a thread per front-end sends those, so a front-end that reads slowly never holds
up the engine. Streams are the engine's; a front-end that disconnects releases its own. With
``EngineProcess(event_loop=True)`` one asyncio event loop does the reading, the engine calls and
the writing instead of those threads (docs/serving.md).

    engine = EngineProcess("hubertsiuzdak/snac_24khz", max_streams=4096)   # in the parent
    client = EngineClient(engine.address)                                  # in each front-end
    sid = await client.open(seed=1)
    pcm = await client.push_ids(sid, ids)     # int16 numpy audio that became final
    tail = await client.flush(sid)
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import operator
import os
import pickle
import queue
import selectors
import socket
import struct
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Client, Connection, Listener

import numpy as np

from snac_fast.orpheus import ORPHEUS, TokenLayout
from snac_fast.serving import PCMBlock, _Batcher, _Request, _streams_done, freeze_startup_objects

# message kinds, front-end -> engine process: pushes (_push_message), ops ("open", req, seed),
# ("flush", req, sid), ("release", sid), ("stats", req); back: an engine call's audio
# (_audio_message, read as ("audio", reqs, offsets, pcm)), or items ("opened", req, sid),
# ("audio", reqs, offsets, pcm), ("error", req, kind, message), ("stats", req, dict)
_ERRORS = {"ValueError": ValueError, "RuntimeError": RuntimeError}
# messages are bytes: an 8-byte tag, then raw arrays (pushes; the audio of an engine call) or a
# pickle (everything else)
_TAG = 8
_PUSH, _OPS, _AUDIO = b"push\0\0\0\0", b"ops\0\0\0\0\0", b"audio\0\0\0"
_AUDIO_HEAD = struct.Struct("<qqq")  # n, samples, 0 for int16 or 1 for float32
_PCM_TYPES = (np.dtype(np.int16), np.dtype(np.float32))
# a message's length before it on the wire, as multiprocessing.connection writes and reads it: a
# big-endian int32, or -1 and a uint64 for 2 GiB and more
_SIZE, _LONG_SIZE = struct.Struct("!i"), struct.Struct("!Q")


class EngineLostError(RuntimeError):
    """The engine process went away (it exited or was killed): every request of its front-ends fails
    with this, at once, until the server is restarted."""


class _Front:
    """The engine process's side of one front-end connection: its streams, and how messages reach it
    (subclasses: a sender thread, or an event loop's transport), never blocking the engine calls on
    a front-end that reads slowly."""

    streams: set[int]

    def send(self, message) -> None:
        """A list of message items (pickled)."""
        raise NotImplementedError

    def send_audio(self, reqs: np.ndarray, offsets: np.ndarray, pcm: np.ndarray) -> None:
        """Requests ``reqs``' audio, ``pcm[offsets[j]:offsets[j + 1]]``, as one raw message."""
        raise NotImplementedError

    def stop(self) -> None:
        """No more messages (the front-end went away)."""

    def error(self, req: int, error: BaseException) -> None:
        self.send([_error_item(req, error)])


class _ThreadFront(_Front):
    """Messages go out through a thread of this front-end's own."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.streams = set()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._send_all, name="snac-fast-engine-sender", daemon=True).start()

    def send(self, message) -> None:
        self._outbox.put(message)

    def send_audio(self, reqs: np.ndarray, offsets: np.ndarray, pcm: np.ndarray) -> None:
        self._outbox.put((reqs, offsets, pcm))

    def stop(self) -> None:
        self._outbox.put(None)

    def _send_all(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                if type(message) is tuple:
                    self.conn.send_bytes(_audio_message(*message))
                else:
                    self.conn.send(message)
            except (OSError, EOFError, BrokenPipeError):  # the front-end is gone: its reader releases its streams
                pass


class _LoopFront(_Front):
    """Messages written to the event loop's transport of this front-end (buffered there: a write
    never waits), framed as ``multiprocessing.connection`` frames them, which the front-end's
    :class:`EngineClient` reads."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.streams = set()

    def send(self, message) -> None:
        self._write(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))

    def send_audio(self, reqs: np.ndarray, offsets: np.ndarray, pcm: np.ndarray) -> None:
        self._write(_audio_message(reqs, offsets, pcm))

    def _write(self, payload: bytes | np.ndarray) -> None:
        if self.writer.is_closing():  # the front-end is gone: its reader releases its streams
            return
        payload = memoryview(payload)  # a transport takes bytes-like objects, not arrays
        size = payload.nbytes
        self.writer.write(_SIZE.pack(size) if size <= 0x7FFFFFFF else _SIZE.pack(-1) + _LONG_SIZE.pack(size))
        self.writer.write(payload)


def _audio_message(reqs: np.ndarray, offsets: np.ndarray, pcm: np.ndarray) -> np.ndarray:
    """The bytes of :meth:`_Front.send_audio`'s message (uint8): the tag, n, the samples, the PCM
    type, then reqs (int64 [n]), offsets (int64 [n + 1]) and the PCM, written once (a pickle
    copied the PCM twice, with the sender thread holding the interpreter)."""
    at = _TAG + _AUDIO_HEAD.size
    out = np.empty(at + 8 * (2 * len(reqs) + 1) + pcm.nbytes, np.uint8)
    out[:_TAG] = np.frombuffer(_AUDIO, np.uint8)
    _AUDIO_HEAD.pack_into(out, _TAG, len(reqs), pcm.size, _PCM_TYPES.index(pcm.dtype))
    for part in (reqs, offsets, pcm):
        out[at:at + part.nbytes].view(part.dtype)[:] = part
        at += part.nbytes
    return out


def _read_audio(data: bytes) -> tuple:
    """:func:`_audio_message`'s message as an item ("audio", reqs, offsets, pcm); the PCM copied
    out (writable, as a pickle's would be)."""
    n, samples, kind = _AUDIO_HEAD.unpack_from(data, _TAG)
    at = _TAG + _AUDIO_HEAD.size
    reqs = np.frombuffer(data, np.int64, n, at)
    offsets = np.frombuffer(data, np.int64, n + 1, at + 8 * n)
    pcm = np.frombuffer(data, _PCM_TYPES[kind], samples, at + 8 * (2 * n + 1)).copy()
    return ("audio", reqs, offsets, pcm)


def _error_item(req: int, error: BaseException) -> tuple:
    """An error as a message item: the front-end raises the same type (ValueError, RuntimeError)."""
    return ("error", req, type(error).__name__, str(error))


def _push_message(reqs: list[int], sids: list[int], frames: int, rows: list[np.ndarray]) -> bytes:
    """Pushes of ``frames`` frames each as one front-end -> engine message: raw int64 arrays (n,
    frames, request numbers, stream ids, level-major rows), not a pickle: cheap for the engine to read."""
    return _PUSH + np.concatenate([np.array([len(reqs), frames], np.int64), np.asarray(reqs, np.int64),
                                   np.asarray(sids, np.int64), np.concatenate(rows).astype(np.int64, copy=False)]).tobytes()


# per push in C, not in a Python loop
_ENDED, _DROPPED, _SLOT = operator.attrgetter("ended"), operator.attrgetter("dropped"), operator.attrgetter("slot")


def _added(seen: set, streams: list) -> bool:
    """Add ``streams`` (none of them in ``seen``) to ``seen`` if none is there twice; else leave
    ``seen`` as it was. Whether they were added."""
    size = len(seen)
    seen.update(streams)
    if len(seen) - size == len(streams):
        return True
    seen.difference_update(streams)
    return False


class _PushBlock:
    """The pushes of one front-end message with one frames count, queued as one item: the engine
    process takes no Python step per push where arrays do (``streams``: the batcher's streams)."""

    __slots__ = ("front", "reqs", "streams", "frames", "rows", "queued_at")

    def __init__(self, front: _Front, reqs: np.ndarray, streams: list, frames: int, rows: np.ndarray) -> None:
        self.front, self.reqs, self.streams, self.frames, self.rows = front, reqs, streams, frames, rows
        self.queued_at = time.monotonic()

    def __len__(self) -> int:
        return len(self.streams)

    def __iter__(self):
        """As single requests (the rare paths: an engine call that failed, closing)."""
        for req, stream, row in zip(self.reqs.tolist(), self.streams, self.rows):
            yield _Request(stream, self.frames, row, False, (self.front, req))

    def part(self, picked: list[int]) -> "_PushBlock":
        return _PushBlock(self.front, self.reqs[picked], [self.streams[j] for j in picked], self.frames, self.rows[picked])

    @staticmethod
    def joined(blocks: list["_PushBlock"]) -> tuple["_PushBlock", np.ndarray, list]:
        """One block of several front-ends' blocks of one frames count, with each push's front-end
        number and the front-ends."""
        fronts: dict[_Front, int] = {}
        numbers = [fronts.setdefault(b.front, len(fronts)) for b in blocks]
        if len(fronts) > 1:  # each front-end's pushes side by side: its reply is one slice of the call's PCM
            order = sorted(range(len(blocks)), key=numbers.__getitem__)
            blocks, numbers = [blocks[i] for i in order], [numbers[i] for i in order]
        front_of = np.repeat(np.asarray(numbers, np.int64), [len(b) for b in blocks])
        if len(blocks) == 1:
            return blocks[0], front_of, list(fronts)
        block = _PushBlock(None, np.concatenate([b.reqs for b in blocks]), [s for b in blocks for s in b.streams],
                           blocks[0].frames, np.concatenate([b.rows for b in blocks]))
        return block, front_of, list(fronts)


class _RowChunk(_PushBlock):
    """One engine call's pushes, from several front-ends (``front_of``: each push's index into
    ``fronts``)."""

    __slots__ = ("front_of", "fronts")

    def __init__(self, block: _PushBlock, front_of: np.ndarray, fronts: list, start: int, stop: int) -> None:
        super().__init__(None, block.reqs[start:stop], block.streams[start:stop], block.frames, block.rows[start:stop])
        self.front_of, self.fronts = front_of[start:stop], fronts

    def __iter__(self):
        for req, stream, row, k in zip(self.reqs.tolist(), self.streams, self.rows, self.front_of.tolist()):
            yield _Request(stream, self.frames, row, False, (self.fronts[k], req))


class _EngineBatcher(_Batcher):
    """The batcher of the engine process: requests come from front-ends, results go back to them,
    one message per front-end per engine call."""

    def _new_future(self):
        raise AssertionError("engine-process requests carry their reply address")

    @staticmethod
    def _pushes(queued) -> int:
        # list() copies a deque without running Python code, so a reader thread's append can't interleave
        return sum(len(item) if type(item) is _PushBlock else 1 for item in list(queued))

    # -- pushes as blocks (the reader thread queues them, the engine thread runs them) --------------

    def _split_round(self, batch: list) -> tuple[list, list]:
        now, carried, seen = [], [], set()
        for item in batch:
            if type(item) is not _PushBlock:
                if item.stream in seen:
                    carried.append(item)
                else:
                    seen.add(item.stream)
                    now.append(item)
            elif seen.isdisjoint(item.streams) and _added(seen, item.streams):  # new streams, none twice
                now.append(item)
            else:  # a stream pushed again before its push ran: the later push waits, in order
                first, later = [], []
                for j, stream in enumerate(item.streams):
                    (later if stream in seen else first).append(j)
                    seen.add(stream)
                now += [item.part(first)] if first else []
                carried.append(item.part(later))
        return now, carried

    def _calls(self, requests: list) -> list:
        by_frames: dict[int, list[_PushBlock]] = {}
        single = []
        for r in requests:
            if type(r) is _PushBlock:
                by_frames.setdefault(r.frames, []).append(r)
            else:
                single.append(r)
        calls = []
        for blocks in by_frames.values():
            block, front_of, fronts = _PushBlock.joined(blocks)
            if any(map(_DROPPED, block.streams)):  # released after its push was queued
                kept = []
                for j, s in enumerate(block.streams):
                    if s.dropped:
                        fronts[front_of[j]].error(int(block.reqs[j]), s.released_error())
                    else:
                        kept.append(j)
                block, front_of = block.part(kept), front_of[kept]
            for start in range(0, len(block), self.max_batch):
                chunk = _RowChunk(block, front_of, fronts, start, start + self.max_batch)
                calls.append((chunk, lambda c=chunk: self.engine.step_rows(list(map(_SLOT, c.streams)), c.rows, c.frames)))
        return calls + (super()._calls(single) if single else [])

    def _mark_done(self, requests: list, now: float) -> None:
        single = []
        for r in requests:
            if type(r) is _PushBlock:
                _streams_done(r.streams, now)
                self.requests += len(r)
            else:
                single.append(r)
        super()._mark_done(single, now)

    def _deliver(self, requests, results) -> None:
        if type(requests) is _RowChunk and isinstance(results, PCMBlock):  # one call's audio: no step per push
            # front_of is sorted (_PushBlock.joined): each front-end's pushes are one run of the call's,
            # its reply a view (a gather per front-end queued for the GIL: docs/serving.md)
            bounds = np.searchsorted(requests.front_of, np.arange(len(requests.fronts) + 1)).tolist()
            for k, front in enumerate(requests.fronts):
                start, stop = bounds[k], bounds[k + 1]
                if stop > start:
                    pcm, offsets = results.span(start, stop)
                    front.send_audio(requests.reqs[start:stop], offsets, pcm)
            return
        if any(type(r) is _PushBlock for r in requests):  # closing: each push of a block gets the error
            pairs = [(x, result) for r, result in zip(requests, results) for x in (r if type(r) is _PushBlock else [r])]
            requests, results = [x for x, _ in pairs], [result for _, result in pairs]
        # a request's future is its reply address (front-end, request number); a release has None
        replies = [r.future for r in requests]
        by_front: dict[_Front, tuple[list, list, list]] = {}
        for reply, result in zip(replies, results):
            if reply is None:
                continue
            front, req = reply
            reqs, pieces, errors = by_front.setdefault(front, ([], [], []))
            if isinstance(result, BaseException):
                errors.append(_error_item(req, result))
            else:
                reqs.append(req)
                pieces.append(result)
        for front, (reqs, pieces, errors) in by_front.items():
            message = errors
            if reqs:
                offsets = np.zeros(len(pieces) + 1, np.int64)
                np.cumsum([p.size for p in pieces], out=offsets[1:])
                message = [("audio", np.asarray(reqs, np.int64), offsets, np.concatenate(pieces))] + errors
            front.send(message)

    def take(self, front: _Front, message: bytes) -> None:
        """Queue one front-end message's requests (the reader thread, or the event loop)."""
        if message[:_TAG] == _PUSH:  # int64: n, frames, then n request numbers, n streams, n rows
            n, frames = np.frombuffer(message, np.int64, 2, _TAG).tolist()
            body = np.frombuffer(message, np.int64, offset=_TAG + 16)
            reqs, sids, rows = body[:n], body[n:2 * n].tolist(), body[2 * n:].reshape(n, -1)
            streams = list(map(self._streams.get, sids))
            if self._stopping or None in streams or any(map(_ENDED, streams)):
                kept = []
                for j, sid in enumerate(sids):
                    try:
                        if self._stopping:
                            raise RuntimeError("the batcher is closed")
                        self._stream(sid)
                        kept.append(j)
                    except (ValueError, RuntimeError) as error:  # that stream ended: only this push fails
                        front.error(int(reqs[j]), error)
                reqs, rows, streams = reqs[kept], rows[kept], [streams[j] for j in kept]
            if streams:
                for stream in streams:
                    stream.queued += 1
                self._pending.append(_PushBlock(front, reqs, streams, frames, rows))
                self._notify()
            return
        for op in pickle.loads(message[_TAG:]):
            kind = op[0]
            try:
                if kind == "open":
                    sid = self.open(op[2])
                    front.streams.add(sid)
                    front.send([("opened", op[1], sid)])
                elif kind == "flush":
                    _, req, sid = op
                    front.streams.discard(sid)
                    self._submit_codes(sid, None, True, future=(front, req))
                elif kind == "release":
                    front.streams.discard(op[1])
                    self.release(op[1])
                elif kind == "stats":
                    front.send([("stats", op[1], {"open_streams": self.open_streams, "batches": self.batches,
                                                  "requests": self.requests, "failed_calls": self.failed_calls,
                                                  "failed_in_a_row": self.failed_in_a_row,
                                                  "last_failure": self.last_failure,
                                                  "step_seconds": self.step_seconds, "gpu_seconds": self.gpu_seconds})])
            except (ValueError, RuntimeError) as error:  # a stream that ended, slots full, batcher closed
                if kind in ("open", "flush", "stats"):
                    front.error(op[1], error)


def _serve_engine(address: str, settings: dict, report: Connection) -> None:
    """The engine process: load, warm up, then accept front-ends until terminated. Threads (the
    default): one reads every front-end, the engine thread runs the engine calls, one per front-end
    sends its replies. ``settings["event_loop"]``: one asyncio event loop does all three (no thread
    takes the interpreter between the engine's CUDA calls: docs/serving.md)."""
    # the engine, reader and sender threads take turns at the interpreter: hand it over within 1 ms,
    # not the default 5, so a push waits less for the engine thread (A/B on an H100: p99 16.7 vs 22.2 ms)
    sys.setswitchinterval(0.001)
    event_loop = settings.get("event_loop", False)
    try:
        import torch

        from snac_fast.api import FastSNAC
        from snac_fast.ops._runtime import make_current

        if settings.get("device"):
            make_current(torch.device(settings["device"]))  # warm-up and graphs on that GPU, not the first
        codec = FastSNAC.from_pretrained(settings["model"], device=settings.get("device"), dtype=settings.get("dtype"),
                                         local_files_only=settings.get("local_files_only", False),
                                         **settings.get("model_options", {}))
        engine = codec.shared_stream_engine(settings.get("lookahead"), max_streams=settings["max_streams"])
        if codec.device.type == "cuda":
            codec.warmup(streams=min(settings["max_batch"], settings["max_streams"]), lookahead=settings.get("lookahead"))
        batcher = _EngineBatcher(engine, max_batch=settings["max_batch"], max_wait_ms=settings.get("max_wait_ms", 0.0),
                                 output=settings["output"],
                                 idle_timeout_s=settings.get("idle_timeout_s"), engine_thread=not event_loop)
        listener = None if event_loop else Listener(address, family="AF_UNIX")
    except BaseException as error:  # noqa: BLE001 - the parent raises it with its message
        report.send(("failed", f"{type(error).__name__}: {error}"))
        raise SystemExit(1) from None
    freeze_startup_objects()  # a full collection would stall every stream's round
    ready = ("ready", {"sampling_rate": codec.sampling_rate, "output": settings["output"], "config": dict(codec.config),
                       "samples_per_frame": engine.samples_per_frame, "max_streams": engine.max_streams,
                       "device": str(codec.device)})
    if event_loop:
        asyncio.run(_serve_on_loop(batcher, address, report, ready))
        return
    report.send(ready)
    # one thread reads every front-end (fewer threads taking turns at the interpreter than one each)
    fronts: dict[Connection, _Front] = {}
    woken, wake = socket.socketpair()
    threading.Thread(target=_read_fronts, args=(batcher, fronts, woken), name="snac-fast-engine-reader",
                     daemon=True).start()
    while True:
        conn = listener.accept()
        fronts[conn] = _ThreadFront(conn)
        wake.send(b"x")


async def _serve_on_loop(batcher: _EngineBatcher, address: str, report: Connection, ready: tuple) -> None:
    """The engine process on one event loop: each front-end's messages read as they come and queued
    (:meth:`_EngineBatcher.take`), the engine calls run by the batcher's pump between those reads,
    the replies written to each front-end's transport."""
    batcher._bind(asyncio.get_running_loop())

    async def front_end(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        front = _LoopFront(writer)
        try:
            while True:  # multiprocessing.connection's framing (what EngineClient sends)
                size, = _SIZE.unpack(await reader.readexactly(_SIZE.size))
                if size == -1:
                    size, = _LONG_SIZE.unpack(await reader.readexactly(_LONG_SIZE.size))
                batcher.take(front, await reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):  # the front-end went away
            pass
        finally:
            writer.close()
            _front_gone(batcher, front)

    try:
        server = await asyncio.start_unix_server(front_end, path=address)
    except OSError as error:
        report.send(("failed", f"{type(error).__name__}: {error}"))
        raise SystemExit(1) from None
    report.send(ready)
    async with server:
        await server.serve_forever()


def _read_fronts(batcher: _EngineBatcher, fronts: dict, woken: socket.socket) -> None:
    selector = selectors.DefaultSelector()  # kept: a new selector per wait costs more than the reads
    selector.register(woken, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is woken:  # new front-ends
                woken.recv(4096)
                for conn, front in list(fronts.items()):
                    if conn not in selector.get_map():
                        selector.register(conn, selectors.EVENT_READ, front)
                continue
            conn, front = key.fileobj, key.data
            try:
                batcher.take(front, conn.recv_bytes())
            except (EOFError, OSError):  # the front-end went away
                selector.unregister(conn)
                del fronts[conn]
                _front_gone(batcher, front)


def _front_gone(batcher: _EngineBatcher, front: _Front) -> None:
    """A front-end disconnected: no more messages to it, and the streams it held are released."""
    front.stop()
    for sid in list(front.streams):
        batcher.release(sid)


class EngineProcess:
    """The engine's process (spawned): ``model`` (a hub id, folder or ``synthetic:`` name) on
    ``device``, ``max_streams`` stream slots, engine calls of at most ``max_batch`` streams, audio
    out as ``output`` (``"int16"`` or ``"float32"`` PCM); ``model_options``: more arguments of
    :meth:`FastSNAC.from_pretrained`. ``event_loop``: one event loop in the engine process reads
    the front-ends, runs the engine calls and writes the replies, instead of a reader thread, an
    engine thread and a sender thread per front-end (as ``AsyncStreamBatcher`` runs its calls on
    the event loop). ``max_wait_ms``: how long a call waits for ``max_batch`` pushes after the first
    queued one (0: launch at once). Measured at 4,096 streams on H100s (docs/serving.md), neither is
    the default: ``event_loop=True, max_wait_ms=4`` met p99 14 ms on a quiet host, no form did on the
    stalling ones. Waits until the model is loaded and warm;
    raises RuntimeError with the process's error if it fails. :attr:`address` is what
    :class:`EngineClient` connects to. Close it (or use it as a context manager) to stop it."""

    def __init__(self, model: str, *, device: str | None = None, dtype: str | None = None, max_streams: int = 4096,
                 max_batch: int = 256, lookahead: int | str | None = None, output: str = "int16",
                 idle_timeout_s: float | None = None, local_files_only: bool = False,
                 model_options: dict | None = None, start_timeout_s: float = 600.0, event_loop: bool = False,
                 max_wait_ms: float = 0.0) -> None:
        if output not in ("int16", "float32"):
            raise ValueError(f"output must be 'int16' or 'float32', got {output!r}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        self._folder = tempfile.mkdtemp(prefix="snac-fast-engine-")
        self.address = os.path.join(self._folder, "engine.sock")
        settings = {"model": model, "device": device, "dtype": dtype, "max_streams": max_streams, "max_batch": max_batch,
                    "lookahead": lookahead, "output": output, "idle_timeout_s": idle_timeout_s,
                    "local_files_only": local_files_only, "model_options": model_options or {}, "event_loop": event_loop,
                    "max_wait_ms": max_wait_ms}
        ours, theirs = mp.Pipe(duplex=False)
        self._process = mp.get_context("spawn").Process(target=_serve_engine, args=(self.address, settings, theirs),
                                                         name="snac-fast-engine", daemon=True)
        self._process.start()
        theirs.close()
        if not ours.poll(start_timeout_s):
            self.close()
            raise RuntimeError(f"the engine process did not start within {start_timeout_s:g} s")
        try:
            status, detail = ours.recv()
        except EOFError:
            status, detail = "failed", f"it exited with code {self._process.exitcode}"
        if status != "ready":
            self.close()
            raise RuntimeError(f"the engine process failed to start: {detail}")
        self.sampling_rate = detail["sampling_rate"]
        # what a front-end needs to know of the engine without a model of its own: the model's
        # config, samples per frame, stream slots, device (its name)
        self.info = detail

    def wait(self) -> int:
        """Block until the engine process ends; its exit status (negative: the signal that ended it)."""
        self._process.join()
        return self._process.exitcode

    def close(self) -> None:
        if self._process.is_alive():
            self._process.terminate()
        self._process.join(10)
        try:
            os.unlink(self.address)
        except FileNotFoundError:
            pass
        try:
            os.rmdir(self._folder)
        except OSError:
            pass

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EngineClient:
    """A front-end's connection to an :class:`EngineProcess`, for asyncio (make and use it in one
    event loop). The same calls as :class:`~snac_fast.serving.AsyncStreamBatcher` (``open`` is
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
                self._conn.send_bytes(_push_message([p[0] for p in group], [p[1] for p in group], frames,
                                                    [p[3] for p in group]))
            if ops:
                self._conn.send_bytes(_OPS + pickle.dumps(ops, pickle.HIGHEST_PROTOCOL))
        except OSError:  # the engine process is gone (its socket closed before the reader saw it)
            self._lost()

    def _read(self) -> None:
        try:
            while True:
                data = self._conn.recv_bytes()
                message = [_read_audio(data)] if data[:_TAG] == _AUDIO else pickle.loads(data)
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
                self._resolve(req, _ERRORS.get(name, RuntimeError)(text))
            else:  # opened, stats
                self._resolve(item[1], item[2])

    def _resolve(self, req: int, value) -> None:
        _Batcher._resolve(self._futures.get(req), value)

    def _lost(self) -> None:
        """The engine process went away: what waits fails, and every later request at once."""
        if self.lost is None:
            self.lost = EngineLostError("the engine process went away (it exited or was killed); "
                                        "restart the server")
        for req in list(self._futures):
            self._resolve(req, self.lost)
