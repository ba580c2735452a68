"""Token layouts: raw language-model token ids <-> SNAC codes, for Orpheus-style TTS models.

Orpheus (and maya1, Kani and others built on snac_24khz) emit 7 ids per coarse frame: slot 0 holds
the level-0 code, slots 1 and 4 the two level-1 codes, slots 2, 3, 5 and 6 the four level-2 codes,
and a slot's id is ``offset + slot * codebook_size + code`` (Orpheus's offset: 128266).
"""

from __future__ import annotations

from dataclasses import dataclass

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
        ids = torch.as_tensor(ids).reshape(-1)
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"token ids must be integers, got {ids.dtype}")
        if ids.numel() % self.frame_size:
            raise ValueError(f"{ids.numel()} token ids are not whole frames of {self.frame_size}")
        codes = self.slot_codes(ids, first_position).view(-1, self.frame_size)
        return [codes[:, [s for s, level in enumerate(self.levels) if level == i]].reshape(1, -1)
                for i in range(self.n_levels)]

    def slot_codes(self, ids: Tensor, first_position: int = 0) -> Tensor:
        """ids (1-D, the first at stream position ``first_position``, a frame start) -> their codes,
        int64 on the CPU; ValueError naming the first id that does not belong to its slot."""
        ids = ids.to("cpu", torch.int64)
        slots = (torch.arange(ids.numel()) + first_position) % self.frame_size
        codes = ids - self.offset - slots * self.codebook_size
        bad = (codes < 0) | (codes >= self.codebook_size)
        if bad.any():
            i = int(bad.nonzero()[0])
            lo = self.offset + int(slots[i]) * self.codebook_size
            raise ValueError(f"token {first_position + i} (id {int(ids[i])}) is not a code of frame slot "
                             f"{int(slots[i])}: expected an id in [{lo}, {lo + self.codebook_size})")
        return codes

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


class TokenFramer:
    """Collects ids pushed in any counts and hands out codes of the whole frames so far, keeping an
    incomplete frame for the next push. Positions in errors count from the stream's first id."""

    def __init__(self, layout: TokenLayout) -> None:
        self.layout = layout
        self.position = 0  # ids turned into codes so far
        self._partial = torch.empty(0, dtype=torch.int64)

    def push(self, ids) -> list[Tensor] | None:
        """Codes of the frames completed by ``ids`` (None when none completed)."""
        ids = torch.as_tensor(ids).reshape(-1)
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"token ids must be integers, got {ids.dtype}")
        held = torch.cat([self._partial, ids.to("cpu", torch.int64)])
        self.layout.slot_codes(held, self.position)  # every id now, the incomplete frame's too
        whole = held.numel() - held.numel() % self.layout.frame_size
        codes = self.layout.ids_to_codes(held[:whole], self.position) if whole else None
        self.position += whole
        self._partial = held[whole:]
        return codes

    def finish(self) -> None:
        """ValueError when an incomplete frame is left over (the stream ends mid-frame)."""
        if self._partial.numel():
            raise ValueError(f"the stream ends inside a frame: {self._partial.numel()} of {self.layout.frame_size} "
                             f"ids after token {self.position - 1}")

