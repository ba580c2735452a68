"""The engine process's batcher: the rounds of :mod:`snac_fast.batching.rounds` over pushes that
arrive as blocks (one front-end message's pushes of one frames count) and whose results go back as
one message per front-end per engine call, so that no step of the engine process is per push."""

from __future__ import annotations

import operator
import pickle
import time

import numpy as np

from snac_fast.batching.defaults import LIBRARY_MAX_WAIT_MS
from snac_fast.batching.drivers import LoopDriver, ThreadDriver
from snac_fast.batching.pcm import PCMBlock
from snac_fast.batching.rounds import BatchRounds, Request, streams_done
from snac_fast.serve.engine.gpu_memory import memory_readings
from snac_fast.serve.engine.wire import PUSH, TAG, error_item, read_pushes
from snac_fast.streaming import StreamEngine

# per push in C, not in a Python loop
_ENDED, _DROPPED, _SLOT = operator.attrgetter("ended"), operator.attrgetter("dropped"), operator.attrgetter("slot")
_STARTED = operator.attrgetter("slot.started")


class Front:
    """The engine process's side of one front-end connection: its streams, and how messages reach it
    (:mod:`snac_fast.serve.engine.process`: a sender thread, or an event loop's transport), never
    blocking the engine calls on a front-end that reads slowly."""

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
        self.send([error_item(req, error)])


def _added(seen: set, streams: list) -> bool:
    """Add ``streams`` (none of them in ``seen``) to ``seen`` if none is there twice; else leave
    ``seen`` as it was. Whether they were added."""
    size = len(seen)
    seen.update(streams)
    if len(seen) - size == len(streams):
        return True
    seen.difference_update(streams)
    return False


class PushBlock:
    """The pushes of one front-end message with one frames count, queued as one item
    (``streams``: the batcher's streams)."""

    __slots__ = ("front", "reqs", "streams", "frames", "rows", "queued_at")

    def __init__(self, front: Front | None, reqs: np.ndarray, streams: list, frames: int, rows: np.ndarray) -> None:
        self.front, self.reqs, self.streams, self.frames, self.rows = front, reqs, streams, frames, rows
        self.queued_at = time.monotonic()

    def __len__(self) -> int:
        return len(self.streams)

    def __iter__(self):
        """As single requests (the rare paths: an engine call that failed, closing)."""
        for req, stream, row in zip(self.reqs.tolist(), self.streams, self.rows):
            yield Request(stream, self.frames, row, False, (self.front, req))

    def part(self, picked: list[int]) -> "PushBlock":
        return PushBlock(self.front, self.reqs[picked], [self.streams[j] for j in picked], self.frames, self.rows[picked])

    @staticmethod
    def joined(blocks: list["PushBlock"]) -> tuple["PushBlock", np.ndarray, list]:
        """One block of several front-ends' blocks of one frames count, with each push's front-end
        number and the front-ends."""
        fronts: dict[Front, int] = {}
        numbers = [fronts.setdefault(b.front, len(fronts)) for b in blocks]
        if len(fronts) > 1:  # each front-end's pushes side by side: its reply is one slice of the call's PCM
            order = sorted(range(len(blocks)), key=numbers.__getitem__)
            blocks, numbers = [blocks[i] for i in order], [numbers[i] for i in order]
        front_of = np.repeat(np.asarray(numbers, np.int64), [len(b) for b in blocks])
        if len(blocks) == 1:
            return blocks[0], front_of, list(fronts)
        block = PushBlock(None, np.concatenate([b.reqs for b in blocks]), [s for b in blocks for s in b.streams],
                          blocks[0].frames, np.concatenate([b.rows for b in blocks]))
        return block, front_of, list(fronts)


class RowChunk(PushBlock):
    """One engine call's pushes, from several front-ends (``front_of``: each push's index into
    ``fronts``)."""

    __slots__ = ("front_of", "fronts")

    def __init__(self, block: PushBlock, front_of: np.ndarray, fronts: list, start: int, stop: int) -> None:
        super().__init__(None, block.reqs[start:stop], block.streams[start:stop], block.frames, block.rows[start:stop])
        self.front_of, self.fronts = front_of[start:stop], fronts

    def __iter__(self):
        for req, stream, row, k in zip(self.reqs.tolist(), self.streams, self.rows, self.front_of.tolist()):
            yield Request(stream, self.frames, row, False, (self.fronts[k], req))


class EngineBatcher(BatchRounds):
    """The batcher of the engine process: requests come from front-ends (:meth:`take`), results go
    back to them. ``event_loop``: its engine calls run on the event loop that :meth:`bind` names
    (the engine process's one loop), else on an engine thread."""

    def __init__(self, engine: StreamEngine, max_batch: int, max_wait_ms: float = LIBRARY_MAX_WAIT_MS, output: str = "int16",
                 idle_timeout_s: float | None = None, event_loop: bool = False) -> None:
        super().__init__(engine, max_batch, max_wait_ms, None, output, idle_timeout_s)
        self.driver = LoopDriver(self) if event_loop else ThreadDriver(self)

    def new_future(self):
        raise AssertionError("engine-process requests carry their reply address")

    @staticmethod
    def count_pushes(queued) -> int:
        # list() copies a deque without running Python code, so a reader thread's append can't interleave
        return sum(len(item) if type(item) is PushBlock else 1 for item in list(queued))

    def split_round(self, batch: list) -> tuple[list, list]:
        now, carried, seen = [], [], set()
        for item in batch:
            if type(item) is not PushBlock:
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

    def calls(self, requests: list) -> list:
        by_frames: dict[int, list[PushBlock]] = {}
        single = []
        for r in requests:
            if type(r) is PushBlock:
                by_frames.setdefault(r.frames, []).append(r)
            else:
                single.append(r)
        calls = []
        for blocks in by_frames.values():
            block, front_of, fronts = PushBlock.joined(blocks)
            if any(map(_DROPPED, block.streams)):  # released after its push was queued
                kept = []
                for j, s in enumerate(block.streams):
                    if s.dropped:
                        fronts[front_of[j]].error(int(block.reqs[j]), s.released_error())
                    else:
                        kept.append(j)
                block, front_of = block.part(kept), front_of[kept]
            for start in range(0, len(block), self.max_batch):
                chunk = RowChunk(block, front_of, fronts, start, start + self.max_batch)
                calls.append((chunk, lambda c=chunk: self.engine.step_rows(list(map(_SLOT, c.streams)), c.rows, c.frames)))
        return calls + (super().calls(single) if single else [])

    def mark_done(self, requests: list, now: float) -> None:
        single = []
        for r in requests:
            if type(r) is PushBlock:
                streams_done(r.streams, now)
                self.requests += len(r)
            else:
                single.append(r)
        super().mark_done(single, now)

    def deliver(self, requests, results) -> None:
        if type(requests) is RowChunk and isinstance(results, PCMBlock):  # one call's audio: no step per push
            # front_of is sorted (PushBlock.joined): each front-end's pushes are one run of the call's,
            # its reply a view (a gather per front-end queued for the GIL: docs/batching.md)
            bounds = np.searchsorted(requests.front_of, np.arange(len(requests.fronts) + 1)).tolist()
            for k, front in enumerate(requests.fronts):
                start, stop = bounds[k], bounds[k + 1]
                if stop > start:
                    pcm, offsets = results.span(start, stop)
                    front.send_audio(requests.reqs[start:stop], offsets, pcm)
            return
        if any(type(r) is PushBlock for r in requests):  # closing: each push of a block gets the error
            pairs = [(x, result) for r, result in zip(requests, results) for x in (r if type(r) is PushBlock else [r])]
            requests, results = [x for x, _ in pairs], [result for _, result in pairs]
        # a request's future is its reply address (front-end, request number); a release has None
        by_front: dict[Front, tuple[list, list, list]] = {}
        for r, result in zip(requests, results):
            if r.future is None:
                continue
            front, req = r.future
            reqs, pieces, errors = by_front.setdefault(front, ([], [], []))
            if isinstance(result, BaseException):
                errors.append(error_item(req, result))
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

    def stats(self) -> dict:
        """The counters a front-end's ``stats`` op reads."""
        return {"open_streams": self.open_streams, "batches": self.batches, "requests": self.requests,
                "failed_calls": self.failed_calls, "failed_in_a_row": self.failed_in_a_row,
                "last_failure": self.last_failure, "step_seconds": self.step_seconds, "gpu_seconds": self.gpu_seconds,
                "memory": memory_readings(self.engine.device)}

    def take(self, front: Front, message: bytes) -> None:
        """Queue one front-end message's requests (the reader thread, or the event loop)."""
        if message[:TAG] == PUSH:
            self._take_pushes(front, message)
            return
        for op in pickle.loads(message[TAG:]):
            kind = op[0]
            try:
                if kind == "open":
                    sid = self.open(op[2])
                    front.streams.add(sid)
                    front.send([("opened", op[1], sid)])
                elif kind == "flush":
                    _, req, sid = op
                    front.streams.discard(sid)
                    self.submit_codes(sid, None, True, future=(front, req))
                elif kind == "release":
                    front.streams.discard(op[1])
                    self.release(op[1])
                elif kind == "stats":
                    front.send([("stats", op[1], self.stats())])
            except (ValueError, RuntimeError) as error:  # a stream that ended, slots full, batcher closed
                if kind in ("open", "flush", "stats"):
                    front.error(op[1], error)

    def _take_pushes(self, front: Front, message: bytes) -> None:
        reqs, sids, frames, rows = read_pushes(message)
        streams = list(map(self.table.open.get, sids))
        if self.intake.stopping or None in streams or any(map(_ENDED, streams)):
            kept = []
            for j, sid in enumerate(sids):
                try:
                    if self.intake.stopping:
                        raise RuntimeError("the batcher is closed")
                    self.table.get(sid)
                    kept.append(j)
                except (ValueError, RuntimeError) as error:  # that stream ended: only this push fails
                    front.error(int(reqs[j]), error)
            reqs, rows, streams = reqs[kept], rows[kept], [streams[j] for j in kept]
        if streams:
            for stream in streams:
                stream.queued += 1
            block = PushBlock(front, reqs, streams, frames, rows)
            self.intake.put(block, block.queued_at, first_audio=not all(map(_STARTED, streams)))
            self.driver.notify()
