"""What waits for a batcher's next round, and when that round launches.

Pushes append to a deque (atomic: no lock on the hot path, any thread) and the driver takes them all
at once. The launch rule is ``max_wait_ms``: an unfilled round starts that long after the last, so
rounds come at most that often while pushes keep coming, but a push after a quieter spell, or one a
stream's first audio waits on, starts one at once. (Held ``max_wait_ms`` from its own arrival
instead, a lone stream's pushes, each awaited before the next, waited the whole time each: its
playback stalled on a CPU.)
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable


class Intake:
    """The queued items of a batcher (its requests, or the engine process's blocks of pushes).

    max_batch: pushes one engine call takes; max_wait_ms: the launch rule above; count_pushes: the
    pushes in a sequence of items (the batcher's hook: an item may hold several)."""

    def __init__(self, max_batch: int, max_wait_ms: float, count_pushes: Callable[[Iterable], int]) -> None:
        self.max_batch, self.max_wait, self.count_pushes = max_batch, max_wait_ms / 1000.0, count_pushes
        self.pending: deque = deque()
        # when the oldest pending push of a stream yet to start was queued (inf: none): a client
        # waits on it for its first audio, so max_wait_ms does not hold it
        self.urgent_since = math.inf
        self.last_round_at = -math.inf  # when the last round took what was pending (time.monotonic)
        self.stopping = False  # the batcher is closing: nothing more is queued

    def __len__(self) -> int:
        return len(self.pending)

    def put(self, item, queued_at: float, first_audio: bool) -> None:
        """Queue ``item`` (queued at ``queued_at``, time.monotonic); ``first_audio``: a stream's first
        audio waits on it. (The batcher refuses items once :attr:`stopping`.)"""
        if first_audio:
            self.urgent_since = min(self.urgent_since, queued_at)
        self.pending.append(item)

    def take(self) -> list:
        """Everything pending now, oldest first (a round starts)."""
        self.urgent_since = math.inf  # before the pops: a push queued meanwhile at worst launches early
        self.last_round_at = time.monotonic()
        return [self.pending.popleft() for _ in range(len(self.pending))]

    def deadline(self) -> float:
        """When (time.monotonic) the pending items' round launches if no fuller call forms."""
        return min(self.last_round_at + self.max_wait, self.urgent_since)

    def wants_more(self, carried: list) -> bool:
        """Whether the next round may wait (until :meth:`deadline`) for fuller calls: ``max_wait_ms``
        is set, items are pending, the batcher is not stopping, and fewer pushes are pending and
        ``carried`` (held from the last round) than one call takes."""
        return bool(self.max_wait and self.pending and not self.stopping
                    and self.count_pushes(self.pending) + self.count_pushes(carried) < self.max_batch)
