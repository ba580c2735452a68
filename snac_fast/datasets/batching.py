"""Clips batched by padded length (within a shard, or across shards in :class:`BatchQueues`),
launched on the codec, and each clip's codes cut back out."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, Iterator, NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from snac_fast.datasets.inputs import Clip
from snac_fast.encoding import GraphedEncode, padding_unit


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
        per_batch = rows_per_batch(length, config, batch_seconds)
        batches += [indices[k:k + per_batch] for k in range(0, len(indices), per_batch)]
    return batches


def rows_per_batch(length: int, config: dict, batch_seconds: float) -> int:
    """Clips of padded ``length`` samples in a batch of at most ``batch_seconds`` (at least one)."""
    return max(1, int(batch_seconds * config["sampling_rate"] // length))


class Batch(NamedTuple):
    """Clips encoded together: what each row is (a clip's index in its shard, or a (shard, index)
    pair of :class:`BatchQueues`), their audio [rows, 1, padded length] on the host (pinned when
    the codec runs on a GPU, zero-padded) and each one's length in samples."""

    rows: list
    audio: Tensor
    lengths: list[int]


@dataclass
class Launched:
    """Batches' encodes in flight (:func:`launch_batches`): (batch, codes) per batch. On a GPU the
    codes are pinned host tensors that the device fills asynchronously: they are complete once
    ``copied`` has passed (one wait for all the batches instead of one sync per batch and level)."""

    batches: list[tuple[Batch, list[Tensor]]]
    copied: torch.cuda.Event | None = None


def build_batch(codec, rows: list, arrays: Sequence[np.ndarray], length: int) -> Batch:
    """A batch of ``arrays`` (one clip's samples each, at most ``length``) zero-padded to ``length``."""
    # pinned: the copy to the GPU neither waits for the queued batches nor holds up the launching thread
    audio = torch.empty((len(arrays), 1, length), dtype=batch_dtype(codec), pin_memory=codec.device.type == "cuda")
    out = audio.numpy()
    for row, samples in enumerate(arrays):
        out[row, 0, :samples.size] = samples
        out[row, 0, samples.size:] = 0
    return Batch(rows, audio, [a.size for a in arrays])


def batch_audio(codec, clips: Sequence[Clip], pad_seconds: float, batch_seconds: float) -> list[Batch]:
    """The readable clips in batches (see :func:`length_batches`); rows are the clips' indices."""
    config = codec.config
    return [build_batch(codec, batch, [clips[i].audio for i in batch],
                        padded_length(clips[batch[0]].audio.size, config, pad_seconds))
            for batch in length_batches(clips, config, pad_seconds, batch_seconds)]


@dataclass
class PendingShard:
    """A shard being encoded across batches (:class:`BatchQueues`): its clips' codes fill in as
    their batches finish; ``pending`` counts the readable clips still out. A batched clip's
    samples are dropped from ``clips`` (the batch holds a copy)."""

    index: int
    clips: list[Clip]
    codes: list[list[np.ndarray] | None]
    pending: int

    @classmethod
    def of(cls, index: int, clips: list[Clip]) -> "PendingShard":
        # a list of its own: batching lets go of each clip's samples in it, not in the caller's list
        return cls(index, list(clips), [None] * len(clips), sum(c.error is None for c in clips))


# a clip waits for its batch to fill while at most this many later shards are queued, then its
# batch leaves part full (a corpus of rare lengths must not hold shards, and their audio, forever)
HOLD_SHARDS = 3


class BatchQueues:
    """Clips of many shards waiting for a batch, one queue per padded length. A queue leaves as a
    batch once it holds ``batch_seconds`` of padded audio: batches of one length then have one shape,
    which comes back and replays a CUDA graph (an eager encode costs ~10 ms of host time to launch,
    a 300 s batch ~17 ms of H100 time: docs/datasets.md). A part-full queue leaves when its oldest
    clip's shard has waited ``hold`` shards, and at :meth:`drain`. Each clip is encoded as if alone
    (``lengths``), so which clips share a batch never changes codes."""

    def __init__(self, codec, pad_seconds: float, batch_seconds: float, hold: int = HOLD_SHARDS) -> None:
        self.codec, self.pad_seconds, self.batch_seconds, self.hold = codec, pad_seconds, batch_seconds, hold
        self._queues: dict[int, list[tuple[int, PendingShard, int]]] = {}  # length -> (serial, shard, index)
        self._serial = 0

    def add(self, shard: PendingShard) -> list[Batch]:
        """Queue ``shard``'s readable clips; returns the batches that leave (rows: (shard, index))."""
        config, serial = self.codec.config, self._serial
        self._serial += 1
        ready = []
        for i, clip in enumerate(shard.clips):
            if clip.error is None:
                length = padded_length(clip.audio.size, config, self.pad_seconds)
                queue = self._queues.setdefault(length, [])
                queue.append((serial, shard, i))
                if len(queue) >= rows_per_batch(length, config, self.batch_seconds):
                    ready.append(self._leave(length))
        for length, queue in list(self._queues.items()):
            if queue[0][0] <= serial - self.hold:
                ready.append(self._leave(length))
        return ready

    def drain(self) -> list[Batch]:
        """Every queued clip, in batches (the input has ended)."""
        return [self._leave(length) for length in sorted(self._queues)]

    def __len__(self) -> int:
        """Clips queued."""
        return sum(len(q) for q in self._queues.values())

    def _leave(self, length: int) -> Batch:
        queue = self._queues.pop(length)
        batch = build_batch(self.codec, [(shard, i) for _, shard, i in queue],
                            [shard.clips[i].audio for _, shard, i in queue], length)
        for _, shard, i in queue:  # the batch holds the samples now: the reader's spool file can go
            shard.clips[i] = dataclasses.replace(shard.clips[i], audio=None)
        return batch


def launch_batches(codec, batches: list[Batch], graphs: GraphedEncode | None = None) -> Launched:
    """Queue the encode of ``batches``, and the copy of their codes to the host, without waiting for
    either; :func:`launched_codes` collects them. Each clip is encoded as if alone (``codec.encode``'s
    ``lengths``): its codes never depend on its batch mates or padding. graphs: replay shapes from
    it (:class:`BatchQueues`' recurring shapes); None: eager (per-shard batches bring ever-new shapes,
    and each capture costs about three encodes)."""
    cuda = codec.device.type == "cuda"
    launched = []
    for batch in batches:
        # read_clip checked the samples already (on the GPU, that scan would wait for the queued batches)
        codes = codec.encode(batch.audio.to(codec.device, non_blocking=True), lengths=batch.lengths,
                             cuda_graphs=graphs is not None, graphs=graphs, check_finite=False)
        if cuda:
            codes = [torch.empty(c.shape, dtype=c.dtype, pin_memory=True).copy_(c, non_blocking=True) for c in codes]
        launched.append((batch, codes))
    copied = None
    if cuda:
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(codec.device))  # the codec's GPU, not the current one
    return Launched(launched, copied)


def corpus_graphs(codec) -> GraphedEncode | None:
    """The graph cache of a corpus encode on ``codec`` (None off CUDA graphs): shapes captured on
    their second batch, all in one memory pool, up to 64 shapes (64 padded lengths)."""
    if codec.encode_graphs is None:
        return None
    # nothing queued yet: free the cached blocks of earlier work (a capture cannot), without a stall
    torch.cuda.synchronize(codec.device)
    torch.cuda.empty_cache()
    return GraphedEncode(codec.model, codec.device, max_graphs=64, capture_at=2, shared_pool=True)


def launched_one_ahead(codec, rounds: Iterable[tuple[object, list[Batch]]],
                       graphs: GraphedEncode | None = None) -> Iterator[tuple[object, Launched]]:
    """(key, launched) of each (key, batches) round of ``rounds``, in order, each yielded once the
    next round is queued on the device (the last once the rounds end): fetching a round's codes
    (:func:`launched_codes`), and whatever the caller does between rounds, overlaps the next round's
    encode. ``graphs``: as :func:`launch_batches`."""
    previous = None
    for key, batches in rounds:
        launched = launch_batches(codec, batches, graphs)
        if previous is not None:
            yield previous
        previous = (key, launched)
    if previous is not None:
        yield previous


def launch_clips(codec, clips: Sequence[Clip], pad_seconds: float, batch_seconds: float) -> Launched:
    """:func:`launch_batches` of :func:`batch_audio`: one shard's encode queued."""
    return launch_batches(codec, batch_audio(codec, clips, pad_seconds, batch_seconds))


def batch_dtype(codec) -> torch.dtype:
    """The dtype batches are built in: the codec's where numpy has it (the model casts to it first
    thing; numpy rounds to float16 as torch does), else float32."""
    return torch.float16 if codec.dtype == torch.float16 else torch.float32


def batch_dtype_of(source, device: str | None = None) -> torch.dtype:
    """:func:`batch_dtype` of the codec ``source`` (a :class:`~snac_fast.datasets.runs.CodecSource`)
    will load, known before it loads; ``device``: where it will load if ``source`` names no device
    (default: this machine's default)."""
    from snac_fast.api import default_device, parse_dtype

    where = torch.device(source.device or device or default_device())
    return torch.float16 if parse_dtype(source.dtype, where) == torch.float16 else torch.float32


def launched_codes(codec, launched: Launched) -> Iterator[tuple[object, list[np.ndarray]]]:
    """(row, codes) of every row of ``launched``'s batches: the codes cut to the clip's length,
    int16 arrays, one per level. Waits for the copies (once)."""
    if launched.copied is not None:
        launched.copied.synchronize()
    for batch, batch_codes in launched.batches:
        levels = [c.numpy().astype(np.int16) for c in batch_codes]  # host tensors (launch_batches)
        for r, (row, samples) in enumerate(zip(batch.rows, batch.lengths)):
            yield row, [level[r, :n] for level, n in zip(levels, code_lengths(samples, codec.config))]


def finish_clips(codec, clips: Sequence[Clip], launched: Launched) -> list[list[np.ndarray] | None]:
    """The codes of :func:`launch_clips`' batches: int16 arrays, one per level, for every readable
    clip; None for the others."""
    codes: list[list[np.ndarray] | None] = [None] * len(clips)
    for i, clip_codes in launched_codes(codec, launched):
        codes[i] = clip_codes
    return codes
