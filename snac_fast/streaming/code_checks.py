"""Checks of the codes a stream engine takes, on the host, before any kernel runs: shapes that
follow the model's ``vq_strides``, integer ids inside its codebook."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from snac_fast.streaming.pending import CheckedCodes

INTEGER_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


def host_numpy(codes: Tensor) -> np.ndarray:
    """A tensor's values as a numpy array of its dtype (a view on the CPU)."""
    return codes.numpy() if codes.is_cpu else codes.cpu().numpy()


def int64_numpy(codes: Tensor) -> np.ndarray:
    """An integer tensor's values as an int64 numpy array (a view where it already is one on the CPU)."""
    a = host_numpy(codes)
    return a if a.dtype == np.int64 else a.astype(np.int64)


class CodeChecker:
    """A stream engine's checks of its inputs, for a model of ``config`` (its ``vq_strides`` and
    ``codebook_size``): one stream's codes (:meth:`check_codes`), many streams' ids in one pass
    (:meth:`check_ids`), a step's codes for all its streams (:meth:`check_step_shapes`)."""

    def __init__(self, config: dict) -> None:
        self.strides = list(config["vq_strides"])
        self.codebook_size = int(config["codebook_size"])
        self.ratios = [self.strides[0] // s for s in self.strides]  # codes of level i per coarse frame
        self._step_config = {**config, "attn_window_size": None}  # a step takes any frame count
        self._step_signatures: set[tuple] = set()  # (type, dtype, shape) per level of step's codes, validated

    def check_codes(self, codes: Sequence[Tensor]) -> CheckedCodes:
        """One stream's codes for k >= 1 new frames: per level [L_i] or [1, L_i] integers (any
        device) with L_i = k * vq_strides[0] / vq_strides[i], ids in [0, codebook_size). Returns
        them as int64 numpy [L_i] (:class:`CheckedCodes`, which :meth:`advance` takes unchecked)."""
        checked = self.check_shapes(codes)
        if not checked.ids_checked:
            self.check_ids([checked])
            checked.ids_checked = True
        return checked

    def check_shapes(self, codes: Sequence[Tensor]) -> CheckedCodes:
        """One stream's codes checked for their shapes alone (ids unchecked), as int64 numpy."""
        if isinstance(codes, CheckedCodes):
            return codes
        n = len(self.strides)
        if not isinstance(codes, (list, tuple)) or not all(isinstance(c, Tensor) for c in codes):
            raise ValueError(f"codes must be a list of {n} tensors, one per level")
        if len(codes) != n:
            raise ValueError(f"this model has {n} code levels (vq_strides {self.strides}), got {len(codes)}")
        checked = CheckedCodes()
        for i, c in enumerate(codes):
            if c.dtype not in INTEGER_DTYPES:
                raise ValueError(f"codes level {i} must be an integer tensor, got {c.dtype}")
            a = int64_numpy(c)
            if a.ndim == 2 and a.shape[0] == 1:
                a = a[0]
            if a.ndim != 1:
                raise ValueError(f"codes level {i} must be [L] or [1, L] for one stream, got {tuple(c.shape)}")
            checked.append(a)
        frames = len(checked[0])
        want = [frames * r for r in self.ratios]
        if frames == 0 or [len(c) for c in checked] != want:
            raise ValueError(f"code lengths {[len(c) for c in checked]} do not follow vq_strides {self.strides}: "
                             f"for {max(frames, 1)} frames expect {[max(frames, 1) * r for r in self.ratios]}")
        checked.frames = frames
        return checked

    def check_ids(self, streams: list[CheckedCodes]) -> None:
        """Every id of every stream in [0, codebook_size): one numpy pass over all of them."""
        if not streams:
            return
        flat = np.concatenate([c.ravel() for codes in streams for c in codes])
        if flat.min() >= 0 and flat.max() < self.codebook_size:
            return
        for codes in streams:
            for i, c in enumerate(codes):
                bad = c[(c < 0) | (c >= self.codebook_size)]
                if bad.size:
                    raise ValueError(f"codes level {i} holds id {bad[0]}, outside [0, {self.codebook_size}) "
                                     "of this model's codebook")

    def check_step_shapes(self, codes: Sequence[Tensor], rows: int) -> None:
        """:func:`validate_codes`' checks of ``step``'s codes (ids aside), run once per distinct
        (type, dtype, shape) of the levels: a server sends the same shapes every step."""
        signature = None
        if type(codes) in (list, tuple):
            try:
                signature = tuple((type(c), c.dtype, c.shape) for c in codes)
            except AttributeError:
                pass
        if signature is None or signature not in self._step_signatures:
            from snac_fast.codes import validate_codes

            validate_codes(codes, self._step_config, check_ids=False)  # [B, L_i] following vq_strides
            if signature is not None and len(self._step_signatures) < 64:
                self._step_signatures.add(signature)
        if codes[0].shape[0] != rows:
            raise ValueError(f"codes hold {codes[0].shape[0]} rows for {rows} streams")
