"""Host PCM of engine calls: one call's audio end to end (:class:`PCMBlock`), and the int16 conversion."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor


class PCMBlock(Sequence):
    """One engine call's host PCM, end to end: ``pcm`` 1-D (int16 or float32), request j's audio
    ``pcm[offsets[j]:offsets[j + 1]]``. A sequence of those pieces (views); :meth:`span` takes
    consecutive ones at once without a Python step per piece."""

    def __init__(self, pcm: np.ndarray, offsets: np.ndarray) -> None:
        self.pcm, self.offsets = pcm, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, j: int) -> np.ndarray:
        if not 0 <= j < len(self):
            raise IndexError(j)
        return self.pcm[self.offsets[j]:self.offsets[j + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        bounds = self.offsets.tolist()
        return (self.pcm[a:b] for a, b in zip(bounds, bounds[1:]))

    def span(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Pieces ``start`` to ``stop - 1`` end to end, without a copy: (pcm 1-D, a view; offsets
        int64 [stop - start + 1] from 0)."""
        offsets = self.offsets[start:stop + 1]
        return self.pcm[offsets[0]:offsets[-1]], offsets - offsets[0]


def int16_pcm(audio: Tensor) -> Tensor:
    """Audio in [-1, 1] (any float dtype, any shape) as int16 PCM: scaled by 32767, rounded, clamped.
    Not in place: a float32 engine's audio is its own buffer."""
    return (audio.float() * 32767.0).round_().clamp_(-32768, 32767).to(torch.int16)
