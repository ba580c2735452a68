"""encode_dataset: shards encoded back to back on one codec (:mod:`.local_engine`) or through Ray
(:mod:`.ray_engine`)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from snac_fast.datasets.batching import (
    batch_audio,
    batch_dtype,
    batch_dtype_of,
    finish_clips,
    launched_one_ahead,
)
from snac_fast.datasets.inputs import Clip, list_inputs
from snac_fast.datasets.local_engine import encode_here, load_batching_in, start_reading
from snac_fast.datasets.ray_engine import encode_with_ray
from snac_fast.datasets.readers import Readers
from snac_fast.datasets.rows import RowFormat, load_tokenizer
from snac_fast.datasets.runs import CodecSource, EncodeSettings, ShardWriting, model_name
from snac_fast.datasets.shards import check_run, require_pyarrow, shard_name


def encode_dataset(source: "str | Path | datasets.Dataset", out: str | Path, codec=None, *,
                   settings: EncodeSettings | None = None, model: str | None = None, device: str | None = None,
                   dtype: str | None = None, model_options: dict | None = None, progress: bool = True,
                   **options: Any) -> dict:
    """Encode every input of ``source`` (see :func:`list_inputs`) into Parquet shards in ``out``
    (see the module docstring). Returns a summary: files, shards written and skipped, seconds of
    audio, errors, wall seconds, and ``per_shard``: each shard written (index, audio seconds,
    errors, ``finished_at`` as ``time.time()``).

    ``settings``: an :class:`~snac_fast.datasets.runs.EncodeSettings` (default: its defaults), any
    of whose fields may be given by name instead (``files_per_shard=64``, ``rows=RowFormat(...)``).
    Its ``engine`` "local": this process encodes with ``codec`` (a FastSNAC; default: ``model``
    loaded by :func:`snac_fast.api.load_codec` with ``device``, ``dtype`` and ``model_options``),
    batching clips of one padded length across shards (a shard is written once all its clips are
    back, so shards may be written out of order). "ray" (needs ``pip install 'snac-fast[ray]'``):
    Ray Data places one actor per GPU of the cluster (one per node on a cluster without GPUs),
    each loading ``model`` itself and running the local engine, reading up to ``loaders`` files at
    a time itself, over its share of the shards (dealt out round-robin when the run starts);
    ``address`` joins a running cluster, else a local one is started. Both engines write the same
    shards. ``rows``: what the rows hold besides the codes (carried columns, ``orpheus_ids``,
    training rows), checked before any input is read."""
    settings = dataclasses.replace(settings or EncodeSettings(), **options).check()
    require_pyarrow()
    rows = settings.rows
    loaders_per_ray_actor = settings.loaders or 16  # and at most its CPUs: this machine's count is not the actors'
    loaders = settings.loaders or min(16, os.cpu_count() or 1)
    source_of_codec = CodecSource(model, device, dtype, dict(model_options or {}))
    if codec is not None and settings.engine == "local":
        rows.check(codec.n_levels)
    if rows.tokenizer:  # a tokenizer that cannot load fails the run now, not at its first shard
        load_tokenizer(rows.tokenizer)
    inputs = list_inputs(source, settings.suffixes, rows.carried)
    if settings.engine == "ray":
        if codec is not None:
            raise ValueError("engine='ray' loads the model in its actors: pass model=, not a codec")
        name = source_of_codec.name
        if rows.format == "orpheus":
            rows.check(len(source_of_codec.checkpoint().config["vq_strides"]))
    elif codec is None:  # loaded below, once the readers are at work; its checkpoint looked up once
        source_of_codec = source_of_codec.found()
        name = source_of_codec.name
        rows.check(len(source_of_codec.model.config["vq_strides"]))
    else:
        name = model_name(codec)
    out = Path(out)
    ids = hashlib.sha256("\n".join(i.id for i in inputs).encode()).hexdigest()
    record = {"model": name, "inputs": len(inputs), "ids_sha256": ids, "files_per_shard": settings.files_per_shard,
              "pad_seconds": settings.pad_seconds}
    if rows != RowFormat():  # a run of plain codes records what it always did
        record["rows"] = rows.to_dict()
    check_run(out, record)
    per_shard = settings.files_per_shard
    shards = [inputs[k:k + per_shard] for k in range(0, len(inputs), per_shard)]
    todo = [n for n in range(len(shards)) if not (out / shard_name(n)).exists()]
    start = time.perf_counter()
    writing = ShardWriting(str(out), settings.pad_seconds, settings.batch_seconds, rows)
    if settings.engine == "ray":
        done = encode_with_ray(shards, todo, source_of_codec, writing, settings.address, loaders_per_ray_actor,
                               progress)
    elif todo:
        rate = codec.sampling_rate if codec is not None else int(source_of_codec.model.config["sampling_rate"])
        dtype = batch_dtype(codec) if codec is not None else batch_dtype_of(source_of_codec)
        with Readers(loaders, rate, dtype) as readers:
            # the model loads while the first shards are read (and after the forks: a process without
            # a CUDA context forks several times faster)
            reads = start_reading(readers, shards, todo)
            codec = codec if codec is not None else load_batching_in(source_of_codec, dtype)
            done = encode_here(shards, todo, codec, writing, readers, progress, start, reads)
    else:
        done = []
    return {"files": len(inputs), "shards": len(shards), "shards_skipped": len(shards) - len(todo),
            "audio_seconds": sum(d["audio_seconds"] for d in done), "errors": sum(d["errors"] for d in done),
            "wall_seconds": time.perf_counter() - start, "per_shard": done}


def encode_back_to_back(codec, shards: Iterable[tuple[int, list[Clip]]], pad_seconds: float,
                        batch_seconds: float) -> Iterator[tuple[int, list[Clip], list[list[np.ndarray] | None]]]:
    """(index, clips, codes) of each (index, clips) shard, in order: each shard's batches are queued
    on the device before the previous shard's codes are fetched, so that host work between shards
    (reading, fetching, writing) overlaps the device's."""
    rounds = (((index, clips), batch_audio(codec, clips, pad_seconds, batch_seconds)) for index, clips in shards)
    for (index, clips), launched in launched_one_ahead(codec, rounds):
        yield index, clips, finish_clips(codec, clips, launched)
