"""A stream engine's state rows: which are free, and per row the keys of its stream's noise."""

from __future__ import annotations

import numpy as np


class SlotTable:
    """The state rows of ``max_streams`` streams plus one scratch row (``max_streams``: the padding
    rows of a batch bucket). Per row the step's key columns, one int64 array [3, max_streams + 1]
    (``keys``) so that a step gathers all three in one indexing: frames consumed, seed, noise row."""

    def __init__(self, max_streams: int) -> None:
        self.max_streams = max_streams
        self.keys = np.zeros((3, max_streams + 1), np.int64)
        self.consumed, self.seeds, self.rows = self.keys
        self.free = list(range(max_streams - 1, -1, -1))

    def take(self, seed: int, row: int) -> int:
        """A free row for a new stream of noise key (``seed``, ``row``), or RuntimeError when none is."""
        if not self.free:
            raise RuntimeError(f"all {self.max_streams} stream slots are in use: finish or close streams, or "
                               "make an engine with a larger max_streams")
        slot = self.free.pop()
        self.consumed[slot], self.seeds[slot], self.rows[slot] = 0, seed, row
        return slot

    def release(self, slot: int) -> None:
        self.free.append(slot)

    @property
    def in_use(self) -> int:
        return self.max_streams - len(self.free)

    def write_keys(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Fill a step's keys, int64 [4, bucket]: per row the state slot, frames consumed, seed and
        noise row of ``slots``; the padding rows past len(slots) get the scratch slot and zeros."""
        n = len(slots)
        keys[0, :n] = slots
        keys[1:, :n] = self.keys[:, slots]
        if n < keys.shape[1]:
            keys[0, n:], keys[1:, n:] = self.max_streams, 0

    def keys_of(self, slots: np.ndarray, bucket: int) -> np.ndarray:
        """A new step's keys (:meth:`write_keys`) for ``slots`` in a batch of ``bucket`` rows."""
        keys = np.empty((4, bucket), np.int64)
        self.write_keys(keys, slots)
        return keys
