"""The Ray Data engine of encode_dataset (``engine='ray'``): one actor per GPU of the cluster, each
running the local engine (its own reader processes, batches across shards, CUDA graphs) over a
share of the shards dealt out round-robin (neighbouring shards, sorted by id, are alike in length).

The engine before this one read shards in Ray tasks and encoded one shard per actor call: an actor
gets no end-of-input call, so it could not keep batches across calls, and its eager encodes ran at
0.69 of the local engine per GPU (H100). With a share per actor, one call encodes it all at the
local engine's rate (0.99-1.02 on one H100, docs/datasets.md). The cost: shares are fixed when the
run starts, so a GPU that runs slower than the others finishes last.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Iterator, NamedTuple

import torch

from snac_fast.datasets.batching import batch_dtype_of
from snac_fast.datasets.local_engine import encode_here, load_batching_in
from snac_fast.datasets.readers import Readers
from snac_fast.datasets.runs import CodecSource, ShardWriting, progress_bar
from snac_fast.datasets.shards import shard_name


class _EncodeShare:
    """A Ray actor, one per GPU: the local engine (``local_engine.encode_here``) over the shards it is
    handed. Its reader processes are forked before the model loads: a process without a CUDA
    context forks several times faster."""

    def __init__(self, shards: list, source: CodecSource, writing: ShardWriting, rate: int, dtype: torch.dtype,
                 loaders: int) -> None:
        self.reader_args = (loaders, rate, dtype)
        self.readers: Readers | None = Readers(*self.reader_args)
        self.codec, self.shards, self.writing = load_batching_in(source, dtype), shards, writing

    def __call__(self, row: dict) -> list[dict]:
        start = time.perf_counter()
        readers, self.readers = self.readers, None  # one share per actor; a second call forks its own
        with readers or Readers(*self.reader_args) as readers:
            return encode_here(self.shards, [int(n) for n in row["share"]], self.codec, self.writing, readers,
                                False, start)


class ActorPlan(NamedTuple):
    actors: int
    cpus: float  # each actor's
    gpus: int  # each actor's: 1, or 0 on a cluster without GPUs (or a run on the CPU)


def _actor_resources(nodes: list[dict], on_gpus: bool) -> ActorPlan:
    """The actors for the cluster's ``nodes`` (``ray.nodes()``): one per GPU, each with the CPUs of
    its node's share (the least of any GPU node, so that every actor can be placed); without GPUs
    (or ``on_gpus`` False), one per node with the CPUs of the smallest."""
    alive = [n["Resources"] for n in nodes if n.get("Alive", True)]
    with_gpus = [r for r in alive if on_gpus and r.get("GPU", 0) >= 1]
    if with_gpus:
        return ActorPlan(sum(int(r["GPU"]) for r in with_gpus),
                         min(r.get("CPU", 0) / int(r["GPU"]) for r in with_gpus), 1)
    with_cpus = [r for r in alive if r.get("CPU", 0) >= 1]
    return ActorPlan(max(1, len(with_cpus)), min((r["CPU"] for r in with_cpus), default=1.0), 0)


def _files_written(out: Path, shards: list, todo: list[int]) -> int:
    """The inputs of the shards ``todo`` whose files are in ``out`` (written whole: renamed when done)."""
    names = {entry.name for entry in os.scandir(out)}
    return sum(len(shards[n]) for n in todo if shard_name(n) in names)


@contextlib.contextmanager
def _watching(out: Path, shards: list, todo: list[int], enabled: bool) -> Iterator[None]:
    """A progress bar over the inputs of ``todo``, moved by the shard files the actors write into
    ``out`` (an actor returns only when its whole share is done)."""
    with progress_bar(sum(len(shards[n]) for n in todo), enabled) as bar:
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(1.0):
                bar.update(_files_written(out, shards, todo) - bar.n)

        watcher = threading.Thread(target=watch, name="snac-fast-ray-progress", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            stop.set()
            watcher.join()
            bar.update(_files_written(out, shards, todo) - bar.n)


def encode_with_ray(shards, todo, source: CodecSource, writing: ShardWriting, address: str | None, loaders: int,
                     progress: bool = False) -> list[dict]:
    """The shards ``todo`` of ``shards`` encoded on a Ray cluster (``address``, else a local one
    started here); each actor reads up to ``loaders`` files at a time. Returns what each shard
    written held, as the local engine does; ``progress``: a bar over the files of the shards written."""
    try:
        import ray
        from ray.data import ActorPoolStrategy
    except ImportError as error:
        raise ImportError("engine='ray' needs Ray Data: pip install 'snac-fast[ray]'") from error
    if not todo:
        return []
    rate = int(source.checkpoint().config["sampling_rate"])
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, log_to_driver=False)
    try:
        actors, cpus, gpus = _actor_resources(ray.nodes(), source.device != "cpu")
        actors = min(actors, len(todo))
        shares = [todo[k::actors] for k in range(actors)]
        settings_of_actor = {"shards": shards, "source": source, "writing": writing, "rate": rate,
                             "dtype": batch_dtype_of(source, "cuda" if gpus else "cpu"),
                             "loaders": max(1, min(loaders, int(cpus)))}
        data = ray.data.from_items([{"share": share} for share in shares], override_num_blocks=actors)
        # one share per actor: by default Ray queues several blocks on the first actor ready
        data = data.flat_map(_EncodeShare, fn_constructor_kwargs=settings_of_actor,
                             compute=ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1),
                             num_gpus=gpus, num_cpus=cpus)
        with _watching(Path(writing.out), shards, todo, progress):
            return data.take_all()
    finally:
        if started:
            ray.shutdown()
