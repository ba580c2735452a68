"""A batcher's streams: each one's engine slot, token framer and activity (:class:`Stream`), and the
table of the open ones, with why the most recent others ended (:class:`StreamTable`), which callers'
threads and the driver's share."""

from __future__ import annotations

import threading
import time

from snac_fast.orpheus import TokenLayout
from snac_fast.streaming import StreamSlot

ENDED_KEPT = 4096  # the reasons of this many recent ends are kept, for the errors of late pushes


class Stream:
    """A batcher's stream: its engine slot, token framer and activity."""

    __slots__ = ("id", "slot", "framer", "last_active", "ended", "dropped", "queued", "done")

    def __init__(self, stream_id: int, slot: StreamSlot, framer) -> None:
        self.id, self.slot, self.framer = stream_id, slot, framer
        self.last_active = time.monotonic()
        # requests queued (by callers) and run (by the engine calls): a stream with one in flight is not idle
        self.queued = self.done = 0
        self.ended: str | None = None  # why it takes no more pushes (flushed, released, ...)
        self.dropped = False  # released without its audio: its queued work is skipped

    def released_error(self) -> ValueError:
        """What a push queued before the stream was released gets."""
        return ValueError(f"stream {self.id} was released ({self.ended})")


class StreamTable:
    """The open streams by id (any thread), each with a framer of ``layout`` (None: codes only), and
    why the :data:`ENDED_KEPT` most recent others ended. Closed once (:meth:`close`): no stream opens
    after."""

    def __init__(self, layout: TokenLayout | None) -> None:
        self.layout = layout
        self.open: dict[int, Stream] = {}
        self._ended: dict[int, str] = {}  # stream id -> why it ended (the most recent ones)
        self._next_id = 0
        self._lock = threading.Lock()
        self.closed = False

    def __len__(self) -> int:
        return len(self.open)

    def __contains__(self, stream_id: int) -> bool:
        return stream_id in self.open

    def add(self, slot: StreamSlot) -> Stream | None:
        """A new stream on ``slot``, or None once the table is closed."""
        with self._lock:
            if self.closed:
                return None
            stream = Stream(self._next_id, slot, self.layout.framer() if self.layout else None)
            self.open[stream.id], self._next_id = stream, self._next_id + 1
        return stream

    def get(self, stream_id: int) -> Stream:
        """An open stream, or the error that says why there is none."""
        stream = self.open.get(stream_id)
        if stream is None or stream.ended:
            if self.closed:
                raise RuntimeError("the batcher is closed")
            why = self._ended.get(stream_id)
            if why is None:
                raise ValueError(f"no open stream {stream_id!r}")
            raise ValueError(f"stream {stream_id} has ended ({why}); open a new one")
        return stream

    def end(self, stream: Stream, why: str, drop: bool = False) -> None:
        """The stream takes no more pushes (``drop``: nor runs what it has queued)."""
        with self._lock:
            stream.ended = stream.ended or why
            stream.dropped = stream.dropped or drop
            if self.open.pop(stream.id, None) is not None:
                self._ended[stream.id] = stream.ended
                if len(self._ended) > ENDED_KEPT:
                    del self._ended[next(iter(self._ended))]

    def idle(self, since: float) -> list[Stream]:
        """The streams no push touched since ``since`` (time.monotonic) and none has in flight."""
        with self._lock:
            return [s for s in self.open.values() if s.last_active < since and s.queued == s.done]

    def close(self) -> list[Stream] | None:
        """Close the table: the streams open until now (None: it was closed already)."""
        with self._lock:
            if self.closed:
                return None
            self.closed = True
            streams = list(self.open.values())
            self.open.clear()
        return streams
