"""Clips batched by padded length, launched on the codec, and each clip's codes cut back out."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from snac_fast.datasets.inputs import Clip
from snac_fast.encoding import padding_unit


def padded_length(samples: int, config: dict, pad_seconds: float) -> int:
    """The length a clip of ``samples`` is encoded at: the next multiple of ``pad_seconds``
    rounded to the padding unit (at least one unit)."""
    unit = padding_unit(config)
    quantum = max(unit, round(pad_seconds * config["sampling_rate"] / unit) * unit)
    return max(1, math.ceil(samples / quantum)) * quantum


def code_lengths(samples: int, config: dict) -> list[int]:
    """Per-level code lengths of ``codec.encode`` of a clip of ``samples``."""
    frames = padded_length(samples, config, 0) // math.prod(config["encoder_rates"])
    return [frames // s for s in config["vq_strides"]]


def length_batches(clips: Sequence[Clip], config: dict, pad_seconds: float, batch_seconds: float) -> list[list[int]]:
    """Indices of ``clips`` (readable ones) grouped into batches of one padded length, each at
    most ``batch_seconds`` of padded audio (at least one clip)."""
    by_length: dict[int, list[int]] = {}
    for i, clip in enumerate(clips):
        if clip.error is None:
            by_length.setdefault(padded_length(clip.audio.size, config, pad_seconds), []).append(i)
    batches = []
    for length, indices in sorted(by_length.items()):
        per_batch = max(1, int(batch_seconds * config["sampling_rate"] // length))
        batches += [indices[k:k + per_batch] for k in range(0, len(indices), per_batch)]
    return batches


@dataclass
class LaunchedShard:
    """A shard's encode in flight (:func:`launch_clips`): (clip indices, codes) per batch. On a GPU
    the codes are pinned host tensors that the device fills asynchronously: they are complete once
    ``copied`` has passed (one wait per shard instead of one sync per batch and level)."""

    batches: list[tuple[list[int], list[Tensor]]]
    copied: torch.cuda.Event | None = None


class Batch(NamedTuple):
    """Clips encoded together: their indices, their audio [rows, 1, padded length] on the host
    (pinned when the codec runs on a GPU, zero-padded) and each one's length in samples."""

    indices: list[int]
    audio: Tensor
    lengths: list[int]


def batch_audio(codec, clips: Sequence[Clip], pad_seconds: float, batch_seconds: float) -> list[Batch]:
    """The readable clips in batches (see :func:`length_batches`)."""
    config = codec.config
    batches = []
    for batch in length_batches(clips, config, pad_seconds, batch_seconds):
        length = padded_length(clips[batch[0]].audio.size, config, pad_seconds)
        # pinned: the copy to the GPU neither waits for the queued batches nor holds up the launching thread
        audio = torch.empty((len(batch), 1, length), dtype=_batch_dtype(codec), pin_memory=codec.device.type == "cuda")
        rows = audio.numpy()
        for row, i in enumerate(batch):
            samples = clips[i].audio.size
            rows[row, 0, :samples] = clips[i].audio
            rows[row, 0, samples:] = 0
        batches.append(Batch(batch, audio, [clips[i].audio.size for i in batch]))
    return batches


def launch_batches(codec, batches: list[Batch]) -> LaunchedShard:
    """Queue the encode of :func:`batch_audio`'s batches, and the copy of their codes to the host,
    without waiting for either; :func:`finish_clips` collects them. Each clip is encoded as if
    alone (``codec.encode``'s ``lengths``): its codes never depend on its batch mates or padding."""
    cuda = codec.device.type == "cuda"
    launched = []
    for batch, audio, lengths in batches:
        # no CUDA graphs: a corpus brings ever-new batch shapes, each capture costs about three encodes;
        # read_clip checked the samples already (on the GPU, that scan would wait for the queued batches)
        codes = codec.encode(audio.to(codec.device, non_blocking=True), lengths=lengths, cuda_graphs=False,
                             check_finite=False)
        if cuda:
            codes = [torch.empty(c.shape, dtype=c.dtype, pin_memory=True).copy_(c, non_blocking=True) for c in codes]
        launched.append((batch, codes))
    copied = None
    if cuda:
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(codec.device))  # the codec's GPU, not the current one
    return LaunchedShard(launched, copied)


def launch_clips(codec, clips: Sequence[Clip], pad_seconds: float, batch_seconds: float) -> LaunchedShard:
    """:func:`launch_batches` of :func:`batch_audio`: one shard's encode queued."""
    return launch_batches(codec, batch_audio(codec, clips, pad_seconds, batch_seconds))


def _batch_dtype(codec) -> torch.dtype:
    """The dtype batches are built in: the codec's where numpy has it (the model casts to it first
    thing; numpy rounds to float16 as torch does), else float32."""
    return torch.float16 if codec.dtype == torch.float16 else torch.float32


def finish_clips(codec, clips: Sequence[Clip], launched: LaunchedShard) -> list[list[np.ndarray] | None]:
    """The codes of :func:`launch_clips`'s batches cut to each clip's length: int16 arrays, one
    per level, for every readable clip; None for the others. Waits for the shard's copies only."""
    if launched.copied is not None:
        launched.copied.synchronize()
    codes: list[list[np.ndarray] | None] = [None] * len(clips)
    for batch, batch_codes in launched.batches:
        levels = [c.numpy().astype(np.int16) for c in batch_codes]  # host tensors (launch_batches)
        for row, i in enumerate(batch):
            codes[i] = [level[row, :n] for level, n in zip(levels, code_lengths(clips[i].audio.size, codec.config))]
    return codes
