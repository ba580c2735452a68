"""Token layouts: raw language-model token ids <-> SNAC codes, for Orpheus-style TTS models.

Orpheus (and maya1, Kani and others built on snac_24khz) emit 7 ids per coarse frame: slot 0 holds
the level-0 code, slots 1 and 4 the two level-1 codes, slots 2, 3, 5 and 6 the four level-2 codes,
and a slot's id is ``offset + slot * codebook_size + code`` (Orpheus's offset: 128266).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenLayout:
    """A frame of ``len(levels)`` ids; ``levels[slot]`` is the code level of that slot (codes of a
    level come in slot order); id = ``offset + slot * codebook_size + code``."""

    offset: int = 128266
    levels: tuple[int, ...] = (0, 1, 2, 2, 1, 2, 2)
    codebook_size: int = 4096

    @property
    def frame_size(self) -> int:
        return len(self.levels)

    @property
    def n_levels(self) -> int:
        return max(self.levels) + 1

    def check_model(self, config: dict) -> None:
        """ValueError unless a frame carries exactly the codes of one coarse frame of this model."""
        strides = config["vq_strides"]
        per_frame = [self.levels.count(i) for i in range(self.n_levels)]
        if per_frame != [strides[0] // s for s in strides] or config["codebook_size"] != self.codebook_size:
            raise ValueError(f"token layout {per_frame} codes per level with codebook {self.codebook_size} does not fit "
                             f"this model (vq_strides {strides}, codebook {config['codebook_size']})")

    def ids_to_codes(self, ids, first_position: int = 0) -> list[Tensor]:
        """ids: whole frames (1-D, length a multiple of :attr:`frame_size`) -> codes, one int64
        [1, L_i] per level. ValueError naming the position (counted from ``first_position``) of
        the first id that does not belong to its slot."""
        ids = as_token_ids(ids)
        if ids.size % self.frame_size:
            raise ValueError(f"{ids.size} token ids are not whole frames of {self.frame_size}")
        return self.split_levels(self.level_major(self.slot_codes(ids, first_position)))

    def slot_codes(self, ids, first_position: int = 0) -> np.ndarray:
        """ids (1-D integers, the first at stream position ``first_position``) -> their codes, int64
        numpy; ValueError naming the first id that does not belong to its slot."""
        ids = as_token_ids(ids)
        codes = ids - self._slot_bases(first_position % self.frame_size, ids.size)
        if codes.size and codes.view(np.uint64).max() >= self.codebook_size:  # negatives wrap high
            i = int(np.flatnonzero((codes < 0) | (codes >= self.codebook_size))[0])
            slot = (first_position + i) % self.frame_size
            lo = self.offset + slot * self.codebook_size
            raise ValueError(f"token {first_position + i} (id {int(ids[i])}) is not a code of frame slot "
                             f"{slot}: expected an id in [{lo}, {lo + self.codebook_size})")
        return codes

    def _slot_bases(self, first_slot: int, count: int) -> np.ndarray:
        """offset + slot * codebook_size for ``count`` ids from slot ``first_slot``, int64."""
        bases = self.__dict__.get("_bases")
        if bases is None or bases.size < count + self.frame_size:
            frames = max(64, -(-count // self.frame_size) + 1)
            bases = np.tile(self.offset + np.arange(self.frame_size, dtype=np.int64) * self.codebook_size, frames)
            self.__dict__["_bases"] = bases  # a frozen dataclass: a cache, not a field
        return bases[first_slot:first_slot + count]

    def level_major(self, slot_codes: np.ndarray) -> np.ndarray:
        """Codes of whole frames in slot order -> the same codes level after level (level 0 of every
        frame, then level 1, ...): the row a stream engine takes, int64 [frames * frame_size]."""
        frames = slot_codes.size // self.frame_size
        orders = self.__dict__.setdefault("_orders", {})
        order = orders.get(frames)
        if order is None:
            slots = np.arange(frames * self.frame_size).reshape(frames, self.frame_size)
            order = np.concatenate([slots[:, [s for s, lv in enumerate(self.levels) if lv == i]].reshape(-1)
                                    for i in range(self.n_levels)])
            if len(orders) < 64:
                orders[frames] = order
        return slot_codes[order]

    def split_levels(self, row: np.ndarray) -> list[Tensor]:
        """A level-major row of whole frames -> codes per level, int64 tensors [1, L_i]."""
        frames = row.size // self.frame_size
        counts = [self.levels.count(i) * frames for i in range(self.n_levels)]
        return [torch.from_numpy(part).view(1, -1) for part in np.split(row, np.cumsum(counts)[:-1])]

    def codes_to_ids(self, codes: list[Tensor]) -> Tensor:
        """codes (per level [1, L_i] or [L_i]) -> 1-D int64 ids, frame after frame."""
        per_level = [c.reshape(-1).to("cpu", torch.int64) for c in codes]
        n = per_level[0].numel()
        frames = torch.empty((n, self.frame_size), dtype=torch.int64)
        used = [0] * self.n_levels
        for slot, level in enumerate(self.levels):
            count = self.levels.count(level)
            frames[:, slot] = per_level[level].view(n, count)[:, used[level]]
            used[level] += 1
        return (frames + self.offset + torch.arange(self.frame_size) * self.codebook_size).reshape(-1)

    def framer(self) -> "TokenFramer":
        return TokenFramer(self)


ORPHEUS = TokenLayout()
CUSTOM_TOKEN_ID = 128256  # in text form an Orpheus LM emits id 128256 + N as <custom_token_N>
# Orpheus's special tokens beside the Llama-3 tokenizer's (its length: 128256); canopylabs' Orpheus
# data scripts and Unsloth's Orpheus notebook
END_OF_TEXT = 128009
START_OF_SPEECH, END_OF_SPEECH = 128257, 128258
START_OF_HUMAN, END_OF_HUMAN = 128259, 128260
START_OF_AI, END_OF_AI = 128261, 128262


def as_token_ids(ids) -> np.ndarray:
    """Token ids (a tensor on any device, a numpy array, a sequence of ints) as a 1-D int64 numpy
    array; ValueError for floats, booleans or anything else that is not integer ids."""
    if isinstance(ids, Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"token ids must be integers, got {ids.dtype}")
        ids = ids.detach().reshape(-1).cpu().numpy()
    else:
        try:
            ids = np.asarray(ids).reshape(-1)
        except (ValueError, TypeError, OverflowError) as error:
            raise ValueError(f"token ids must be integers: {error}") from None
    if ids.size == 0:
        return np.empty(0, np.int64)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got {ids.dtype}")
    return ids.astype(np.int64, copy=False)  # uint64 past int64 wraps negative: reported as a bad id


class TokenFramer:
    """Collects ids pushed in any counts and hands out codes of the whole frames so far, keeping an
    incomplete frame for the next push. Positions in errors count from the stream's first id.
    Host work only (numpy, no torch calls): a server frames every push of every stream."""

    __slots__ = ("layout", "position", "_partial")

    def __init__(self, layout: TokenLayout) -> None:
        self.layout = layout
        self.position = 0  # ids turned into codes so far
        self._partial = np.empty(0, np.int64)  # codes of an incomplete frame

    def push_row(self, ids) -> tuple[int, np.ndarray | None]:
        """(frames completed by ``ids``, their codes as a level-major row int64 [frames * frame_size],
        :meth:`TokenLayout.level_major`), or (0, None). Every id is checked now, the incomplete
        frame's too; a bad id raises ValueError and leaves the framer as it was."""
        codes = self.layout.slot_codes(ids, self.position + self._partial.size)
        if self._partial.size:
            codes = np.concatenate([self._partial, codes])
        size = self.layout.frame_size
        whole = codes.size - codes.size % size
        self._partial = codes[whole:]
        if not whole:
            return 0, None
        self.position += whole
        return whole // size, self.layout.level_major(codes[:whole])

    def push(self, ids) -> list[Tensor] | None:
        """Codes of the frames completed by ``ids`` (per level int64 [1, L_i]), None when none completed."""
        frames, row = self.push_row(ids)
        return None if row is None else self.layout.split_levels(row)

    def drop_incomplete(self) -> int:
        """Forget the ids of an incomplete frame (an LM stopped mid-frame); returns how many."""
        dropped, self._partial = self._partial.size, self._partial[:0]
        return dropped

    def finish(self) -> None:
        """ValueError when an incomplete frame is left over (the stream ends mid-frame)."""
        if self._partial.size:
            raise ValueError(f"the stream ends inside a frame: {self._partial.size} of {self.layout.frame_size} "
                             f"ids after token {self.position - 1}")
