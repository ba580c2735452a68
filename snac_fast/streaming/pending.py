"""Codes pushed to a stream engine but not decoded yet, for every state slot at once."""

from __future__ import annotations

import numpy as np


class CheckedCodes(list):
    """One stream's codes after :meth:`StreamEngine.check_codes`: per level an int64 numpy [L_i]."""

    frames: int = 0
    ids_checked: bool = False


class PendingCodes:
    """Codes pushed but not decoded yet, for every state slot at once, so that a step gathers the
    codes of all its streams in one numpy indexing per level (no per-stream tensor work). Level i
    holds ``ratios[i]`` codes per frame in a buffer [slots, capacity * ratios[i]]; a slot's pending
    frames are [head, tail) of its row. ``frames_held``: the sum over slots (0 in a server's steady
    state, which then skips a per-slot look)."""

    def __init__(self, slots: int, ratios: list[int], capacity: int = 32) -> None:
        self.ratios, self.capacity = ratios, capacity
        self.levels = [np.zeros((slots, capacity * r), np.int64) for r in ratios]
        self.head = np.zeros(slots, np.int64)
        self.tail = np.zeros(slots, np.int64)
        self.frames_held = 0

    def held(self, slot: int) -> int:
        return int(self.tail[slot] - self.head[slot])

    def _make_room(self, slot: int, frames: int) -> None:
        """Move the row's pending frames to its start, growing every row if ``frames`` more still do not fit."""
        head, tail = int(self.head[slot]), int(self.tail[slot])
        held = tail - head
        if held + frames > self.capacity:
            self.capacity = max(2 * self.capacity, held + frames)
            self.levels = [np.pad(level, ((0, 0), (0, self.capacity * r - level.shape[1])))
                           for level, r in zip(self.levels, self.ratios)]
        for level, r in zip(self.levels, self.ratios):
            level[slot, :held * r] = level[slot, head * r:tail * r].copy()
        self.head[slot], self.tail[slot] = 0, held

    def put(self, slot: int, codes: CheckedCodes) -> None:
        frames = codes.frames
        if self.tail[slot] + frames > self.capacity:
            self._make_room(slot, frames)
        tail = int(self.tail[slot])
        for level, c, r in zip(self.levels, codes, self.ratios):
            level[slot, tail * r:(tail + frames) * r] = c
        self.tail[slot] = tail + frames
        self.frames_held += frames

    def put_rows(self, slots: np.ndarray, codes: list[np.ndarray], frames: int) -> None:
        """``frames`` new frames for each of ``slots`` (distinct): per level int64 [len(slots), frames * ratio]."""
        for slot in slots[self.tail[slots] + frames > self.capacity]:
            self._make_room(int(slot), frames)
        for level, c, r in zip(self.levels, codes, self.ratios):
            level[slots[:, None], self.tail[slots, None] * r + np.arange(frames * r)] = c
        self.tail[slots] += frames
        self.frames_held += frames * len(slots)

    def take(self, slots: np.ndarray, frames: int) -> list[np.ndarray]:
        """The next ``frames`` frames of every slot in ``slots``: per level int64 [len(slots), frames * ratio]."""
        taken = []
        for level, r in zip(self.levels, self.ratios):
            columns = self.head[slots, None] * r + np.arange(frames * r)
            taken.append(level[slots[:, None], columns])
        self.head[slots] += frames
        self.frames_held -= frames * len(slots)
        return taken

    def take_all(self, slot: int) -> list[np.ndarray]:
        codes = self.peek_all(slot)
        self.frames_held -= self.held(slot)
        self.head[slot] = self.tail[slot]
        return codes

    def peek_all(self, slot: int) -> list[np.ndarray]:
        """A copy of the slot's pending codes, left pending: per level int64 [frames * ratio]."""
        head, tail = int(self.head[slot]), int(self.tail[slot])
        return [level[slot, head * r:tail * r].copy() for level, r in zip(self.levels, self.ratios)]

    def clear(self, slot: int) -> None:
        self.frames_held -= self.held(slot)
        self.head[slot] = self.tail[slot] = 0


