"""Validation of codes and audio, and token files (what ``torch.save(codes)`` writes)."""

from __future__ import annotations

import functools
import math
import operator
import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

TOKEN_FILE_KEYS = {"codes", "model"}


def validate_codes(codes: object, config: dict, check_ids: bool = True) -> list[Tensor]:
    """Check codes against a model config before any kernel runs; ValueError names what is wrong.

    codes: one integer tensor [B, L_i] per level (``len(config["vq_strides"])`` levels), with
    L_i * vq_strides[i] equal across levels, ids in [0, codebook_size), equal batch sizes.
    check_ids=False leaves the id range to the caller (:func:`check_code_ids`; a CUDA-graph decode
    flags bad ids inside its codebook kernel instead of syncing with the GPU before the launch).
    """
    strides = config["vq_strides"]
    if isinstance(codes, Tensor):
        raise ValueError(f"codes must be a list of {len(strides)} tensors, one per level, not a single tensor")
    if not isinstance(codes, (list, tuple)) or not all(isinstance(c, Tensor) for c in codes):
        raise ValueError(f"codes must be a list of {len(strides)} tensors, got {type(codes).__name__}")
    if len(codes) != len(strides):
        raise ValueError(f"this model has {len(strides)} code levels (vq_strides {strides}), got {len(codes)}")
    for i, c in enumerate(codes):
        if c.dtype.is_floating_point or c.dtype.is_complex or c.dtype == torch.bool:
            raise ValueError(f"codes level {i} must be an integer tensor, got {c.dtype}")
        if c.dim() != 2:
            raise ValueError(f"codes level {i} must be shaped [B, L], got {tuple(c.shape)}")
    batch = {c.shape[0] for c in codes}
    if len(batch) != 1:
        raise ValueError(f"codes levels have different batch sizes: {[c.shape[0] for c in codes]}")
    if codes[0].shape[0] == 0:
        raise ValueError("codes have batch size 0")
    latent = codes[-1].shape[1] * strides[-1]
    expected = [latent // s if latent % s == 0 else None for s in strides]
    lengths = [c.shape[1] for c in codes]
    if lengths != expected or latent == 0:
        coarse = max(1, lengths[0])
        want = [coarse * strides[0] // s for s in strides]
        raise ValueError(f"code lengths {lengths} do not follow vq_strides {strides}: for {coarse} coarse frames expect {want}")
    window = config.get("attn_window_size")
    if window and latent % window:
        step = window // strides[0] if window % strides[0] == 0 else window
        raise ValueError(f"this model's attention needs the latent length ({latent} = {lengths[0]} coarse frames x {strides[0]}) "
                         f"to be a multiple of {window}: use a multiple of {step} coarse frames")
    if check_ids:
        check_code_ids(codes, config["codebook_size"])
    return list(codes)


def check_code_ids(codes: list[Tensor], size: int) -> None:
    """ValueError naming the level and the id when an id is outside [0, size). One reduction for
    all levels (and one host sync when the codes live on a GPU)."""
    lo, hi = torch.stack(torch.cat([c.reshape(-1) for c in codes]).aminmax()).tolist()
    if lo < 0 or hi >= size:
        for i, c in enumerate(codes):  # the error path may take its time: name the level
            bad = c[(c < 0) | (c >= size)]
            if bad.numel():
                raise ValueError(f"codes level {i} holds id {bad[0].item()}, outside [0, {size}) of this model's codebook")


def validate_audio(audio: object, check_finite: bool = True) -> Tensor:
    """audio must be a floating tensor [B, 1, T] with T >= 1 and (unless not asked) finite samples."""
    if not isinstance(audio, Tensor):
        raise ValueError(f"audio must be a tensor shaped [B, 1, T], got {type(audio).__name__}")
    if audio.dim() != 3 or audio.shape[1] != 1:
        raise ValueError(f"audio must be shaped [B, 1, T] (mono), got {tuple(audio.shape)}")
    if not audio.dtype.is_floating_point:
        raise ValueError(f"audio must be floating point, got {audio.dtype}")
    if audio.shape[0] == 0 or audio.shape[2] == 0:
        raise ValueError(f"audio is empty: shape {tuple(audio.shape)}")
    if check_finite and not torch.isfinite(audio).all():
        raise ValueError("audio holds NaN or infinite samples")
    return audio


def validate_lengths(lengths: object, audio: Tensor) -> list[int]:
    """lengths must give one whole number of samples per row of audio [B, 1, T], each in [1, T]."""
    if isinstance(lengths, Tensor):
        if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise ValueError(f"lengths must be a 1-D integer tensor, got {lengths.dtype} of shape {tuple(lengths.shape)}")
        lengths = lengths.tolist()
    try:
        values = [operator.index(n) for n in lengths]
    except TypeError:
        raise ValueError("lengths must be whole numbers of samples, one per row of audio") from None
    batch, samples = audio.shape[0], audio.shape[-1]
    if len(values) != batch:
        raise ValueError(f"lengths has {len(values)} entries for {batch} rows of audio")
    bad = [n for n in values if not 1 <= n <= samples]
    if bad:
        raise ValueError(f"lengths must lie in [1, {samples}] (the audio's length), got {bad[0]}")
    return values


def read_mono(source) -> tuple[Tensor, int]:
    """An audio file (a path or a binary file object, any format soundfile reads) as mono float32
    [T] (channels averaged) and its sampling rate. Unreadable input raises soundfile's error;
    ValueError when it holds no samples or non-finite ones."""
    import soundfile

    data, rate = soundfile.read(source, dtype="float32", always_2d=True)
    if data.shape[0] == 0:
        raise ValueError("holds no samples")
    # [frames, channels] -> [frames]; one channel is its own mean (no copy: corpus readers are CPU-bound)
    mono = torch.from_numpy(data[:, 0]) if data.shape[1] == 1 else torch.from_numpy(data).mean(dim=1)
    # a float64 sum is finite iff every sample is (float32 magnitudes cannot overflow it): one pass, no mask
    if not np.isfinite(np.sum(mono.numpy(), dtype=np.float64)):
        raise ValueError("holds non-finite samples")
    return mono, int(rate)


# resample_mono's input lengths are rounded up to a multiple of this (zeros appended), below
# RESAMPLE_BUCKETS_UP_TO samples: past it the conv's set-up is a few percent of its run, and the
# padded copy would be one more copy of a long input in memory
RESAMPLE_BUCKET = 1 << 14
RESAMPLE_BUCKETS_UP_TO = 1 << 22


@functools.lru_cache(maxsize=16)
def _resampler(rate: int, new_rate: int):
    """torchaudio's Resample (the functional resample's kernel, built once: ~0.25 ms of small torch
    ops a call otherwise, under the GIL that a reader process's threads share)."""
    import torchaudio.transforms

    return torchaudio.transforms.Resample(rate, new_rate, dtype=torch.float32)


def resample_mono(mono: Tensor, rate: int, new_rate: int) -> Tensor:
    """``torchaudio.functional.resample`` of ``mono`` (float32 [..., T] -> [..., T']) from ``rate``
    to ``new_rate``, the input (if shorter than ``RESAMPLE_BUCKETS_UP_TO`` samples) zero-padded to a
    multiple of ``RESAMPLE_BUCKET`` samples and the output cut to the length resample gives ``mono``. Resample pads with zeros itself, so these are
    its samples up to float32 rounding (torch's CPU conv may sum in another order for another
    length; within 1e-6 of the peak, tested): torch's CPU conv sets itself up for every new input
    length (1-15 ms each), so a corpus of distinct lengths read 2-3x slower per file without the
    buckets (docs/datasets.md)."""
    if rate == new_rate:
        return mono
    samples = mono.shape[-1]
    if samples >= RESAMPLE_BUCKETS_UP_TO:
        return _resampler(rate, new_rate)(mono)
    padded = torch.nn.functional.pad(mono, (0, -samples % RESAMPLE_BUCKET))
    # resample's own output length for ``samples``, as it computes it (in float32: long inputs can
    # come out one sample shorter than the exact ceiling)
    gcd = math.gcd(rate, new_rate)
    length = int(torch.ceil(torch.as_tensor(new_rate // gcd * samples / (rate // gcd))))
    return _resampler(rate, new_rate)(padded)[..., :length]


def save_tokens(path: str | os.PathLike, codes: list[Tensor], model: str | None = None) -> None:
    """Write a token file: ``{"codes": [...], "model": model}`` (codes moved to CPU)."""
    payload: dict = {"codes": [c.detach().cpu() for c in codes]}
    if model is not None:
        payload["model"] = model
    torch.save(payload, path)


def load_tokens(path: str | os.PathLike) -> tuple[list[Tensor], str | None]:
    """Read a token file: the list upstream ``encode`` returns, as ``torch.save`` wrote it, or a dict
    ``{"codes": [...], "model": repo-or-path}``. Loaded with ``weights_only=True``.
    Returns (codes, model name or None). ValueError for anything else."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"token file {str(p)!r} is a directory, not a file")
    if not p.is_file():
        raise ValueError(f"token file {str(p)!r} does not exist")
    try:
        payload = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle/zip errors of many types for a foreign or truncated file
        raise ValueError(f"cannot read token file {str(p)!r}: not a torch.save file of codes ({type(e).__name__})") from e
    model = None
    if isinstance(payload, dict):
        unknown = set(payload) - TOKEN_FILE_KEYS
        if "codes" not in payload or unknown:
            raise ValueError(f"token file {str(p)!r} must hold a list of code tensors or a dict with keys "
                             f"'codes' and optionally 'model'; found keys {sorted(payload)}")
        model = payload.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"token file {str(p)!r}: 'model' must be a string, got {type(model).__name__}")
        payload = payload["codes"]
    if not isinstance(payload, (list, tuple)) or not payload or not all(isinstance(c, Tensor) for c in payload):
        raise ValueError(f"token file {str(p)!r} must hold a non-empty list of code tensors, got {type(payload).__name__}")
    return list(payload), model
