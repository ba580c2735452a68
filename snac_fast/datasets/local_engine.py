"""The local engine: one codec encodes shards back to back (the Ray engine's actors run it too).
Its launching thread only launches encodes; a helper thread gathers each shard's clips into
batches across shards, another fetches the codes and writes each shard once all its clips are
back (docs/datasets.md)."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from snac_fast.datasets.batching import (
    Batch,
    BatchQueues,
    Launched,
    PendingShard,
    batch_dtype,
    corpus_graphs,
    launch_batches,
    launched_codes,
)
from snac_fast.datasets.inputs import Clip
from snac_fast.datasets.readers import READ_AHEAD, Readers
from snac_fast.datasets.runs import CodecSource, ShardWriting, model_name, progress_bar
from snac_fast.datasets.shards import shard_name, shard_table, write_atomically


def write_shard(codec, clips: Sequence[Clip], codes: Sequence[list[np.ndarray] | None], index: int,
                writing: ShardWriting) -> dict:
    """Write one shard's file; returns what it held (audio seconds, errors)."""
    table = shard_table(clips, codes, model_name(codec), codec.n_levels, writing.rows)
    write_atomically(table, Path(writing.out) / shard_name(index))
    return {"shard": index, "audio_seconds": sum(c.duration or 0.0 for c in clips),
            "errors": sum(c.error is not None for c in clips), "finished_at": time.time()}


def load_batching_in(source: CodecSource, dtype: torch.dtype):
    """``source``'s codec, checked to build its batches in ``dtype``, the dtype its readers were
    started with (:func:`batch_dtype_of` must agree with what ``from_pretrained`` made)."""
    codec = source.load()
    if batch_dtype(codec) != dtype:  # the readers' samples would be converted again, or rounded differently
        raise RuntimeError(f"the readers made {dtype} samples, the codec batches {batch_dtype(codec)}")
    return codec


def start_reading(readers: Readers, shards, todo) -> dict[int, list[Future]]:
    """The reads of the first ``READ_AHEAD`` shards to do, submitted (by position in ``todo``)."""
    return {k: readers.submit(shards[todo[k]]) for k in range(min(READ_AHEAD, len(todo)))}


def encode_here(shards, todo, codec, writing: ShardWriting, readers: Readers, progress, start,
                 reads: dict[int, list[Future]] | None = None) -> list[dict]:
    """The local engine (the Ray engine's actors run it too). This thread only launches encodes; one
    helper thread collects each shard's audio from ``readers`` (reading ``READ_AHEAD`` shards ahead) and queues its
    clips for batches across shards (:class:`BatchQueues`: the batches of a length have one shape and
    replay a CUDA graph), another fetches the codes and writes each shard once all its clips are
    back. With all of that in it, the launching thread was the bottleneck (docs/datasets.md).
    ``reads``: the first shards' reads if already submitted (:func:`start_reading`)."""
    done: list[dict] = []
    queues = BatchQueues(codec, writing.pad_seconds, writing.batch_seconds)
    graphs = corpus_graphs(codec)
    open_shards: list[PendingShard] = []  # the writer thread's: shards with codes still out
    with progress_bar(sum(len(shards[n]) for n in todo), progress) as bar, \
            ThreadPoolExecutor(1, "snac-fast-batches") as batcher, ThreadPoolExecutor(1, "snac-fast-writer") as writer:
        reads = reads if reads is not None else start_reading(readers, shards, todo)

        def read(k: int) -> None:
            if k < len(todo):
                reads[k] = readers.submit(shards[todo[k]])

        def prepare(k: int) -> tuple[PendingShard, list[Batch]]:
            shard = PendingShard.of(todo[k], readers.collect(shards[todo[k]], reads.pop(k)))
            read(k + READ_AHEAD)  # the readers never wait for this thread
            if k == len(todo) - 1:
                readers.release()
            batches = queues.add(shard)
            return shard, batches + (queues.drain() if k == len(todo) - 1 else [])

        def finish(shard: PendingShard, launched: Launched) -> list[dict]:
            open_shards.append(shard)  # before any of its codes: they come in this round or later
            for (owner, i), codes in launched_codes(codec, launched):
                owner.codes[i] = codes
                owner.pending -= 1
            complete = [s for s in open_shards if not s.pending]
            open_shards[:] = [s for s in open_shards if s.pending]
            return [write_shard(codec, s.clips, s.codes, s.index, writing) for s in complete]

        def written(future: Future) -> None:
            for shard in future.result():
                done.append(shard)
                bar.update(len(shards[shard["shard"]]))
            hours = sum(d["audio_seconds"] for d in done) / 3600
            bar.set_postfix_str(f"{hours / (time.perf_counter() - start):.4f} h audio/s")

        if todo:
            prepared = batcher.submit(prepare, 0)
        writes: list[Future] = []
        for k in range(len(todo)):
            shard, batches = prepared.result()
            if k + 1 < len(todo):
                prepared = batcher.submit(prepare, k + 1)
            writes.append(writer.submit(finish, shard, launch_batches(codec, batches, graphs)))
            while len(writes) > 1 or (writes and writes[0].done()):  # at most two rounds in flight
                written(writes.pop(0))
        for future in writes:
            written(future)
    return done
