"""The Ray Data engine of encode_dataset (``engine='ray'``): shards read by CPU tasks and encoded by
actors, three per GPU by default (each with a third of it: one actor's interpreter cannot launch
the encodes as fast as the GPU runs them; on an H100 one GPU ran 229.8 h/min with two actors and
253.3 with three, docs/datasets.md).

A reading task hands its shard over as one flat array of every clip's samples, already in the
dtype the encoder's batches are built in, plus the clips' small records: Ray keeps the array in its
object store and the actor reads it in place. (The first version pickled the clips: on an H200 the
actor then spent longer unpickling and converting a 256-file shard than the GPU spent encoding it,
and the engine ran at 0.41 of the local one; docs/datasets.md.) Each GPU actor takes two shards
at a time, so that one shard's batching, code copies and file write overlap the other's encode.
"""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np

from snac_fast.datasets.encode import encode_shard
from snac_fast.datasets.inputs import Clip, read_clip
from snac_fast.datasets.runs import _load

# shards an actor holds at once: on a GPU one encoding while the other is batched or written; a CPU
# actor's encode is its own host work
CALLS_PER_GPU_ACTOR = 2
CALLS_PER_CPU_ACTOR = 1
# CPUs Ray reserves for each GPU actor, the reading tasks taking the rest: its launching, batching
# and writing threads need cores that the reads, at Ray's default priority, would otherwise take
# (2 GPUs: 447 h/min against 427 with none reserved, docs/datasets.md)
CPUS_PER_GPU_ACTOR = 2.0


def _read_shard(row: dict, shards: list, rate: int, dtype: str) -> dict:
    """A Ray task: read one shard's audio (CPU). Returns the shard's index, every readable clip's
    samples end to end in ``dtype`` (float16 or float32, 1-D) and the pickled clips without them."""
    clips = [read_clip(item, rate) for item in shards[row["shard"]]]
    pieces = [c.audio.astype(dtype, copy=False) for c in clips if c.audio is not None]
    audio = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    records = [dataclasses.replace(c, audio=None) for c in clips]
    sizes = [0 if c.audio is None else c.audio.size for c in clips]
    return {"shard": row["shard"], "audio": audio, "clips": pickle.dumps((records, sizes))}


def _clips_of(row: dict) -> list[Clip]:
    """The clips of :func:`_read_shard`'s row, each one's samples a view of the row's array."""
    records, sizes = pickle.loads(row["clips"])
    audio, at, clips = np.asarray(row["audio"]), 0, []
    for record, size in zip(records, sizes):
        clips.append(record if record.error is not None else dataclasses.replace(record, audio=audio[at:at + size]))
        at += size
    return clips


class _EncodeShard:
    """A Ray actor: one FastSNAC, encoding and writing whole shards."""

    def __init__(self, load: dict, settings: dict, dtype: str) -> None:
        from snac_fast.datasets.batching import _batch_dtype

        self.codec, self.settings = _load(**load), settings
        made = str(_batch_dtype(self.codec)).replace("torch.", "")
        if made != dtype:  # the readers' samples would be converted again, or rounded differently
            raise RuntimeError(f"the reading tasks made {dtype} samples, the codec batches {made}")

    def __call__(self, row: dict) -> dict:
        return encode_shard(self.codec, _clips_of(row), int(row["shard"]), self.settings)


def _gpu_actor_cpus(cpus: float, actors: int) -> float:
    """CPUs each GPU actor reserves: :data:`CPUS_PER_GPU_ACTOR`, less on a small cluster so that the
    actors hold at most half of its ``cpus`` (the rest read; more would leave actors unplaceable)."""
    return min(CPUS_PER_GPU_ACTOR, cpus / (2 * actors))


def _batch_dtype_name(load: dict, gpus: int) -> str:
    """The dtype the actors' codecs build batches in (``batching._batch_dtype``), known before any
    actor exists: float16 for a float16 codec, else float32."""
    import torch

    from snac_fast.api import parse_dtype

    device = torch.device(load.get("device") or ("cuda" if gpus else "cpu"))
    return "float16" if parse_dtype(load.get("dtype"), device) == torch.float16 else "float32"


def _encode_with_ray(shards, todo, load: dict, settings: dict, address: str | None, cpu_actors: int,
                     actors_per_gpu: int = 3) -> list[dict]:
    try:
        import ray
        from ray.data import ActorPoolStrategy
    except ImportError as error:
        raise ImportError("engine='ray' needs Ray Data: pip install 'snac-fast[ray]'") from error
    from snac_fast.loading import resolve_checkpoint

    if not todo:
        return []
    rate = resolve_checkpoint(load["model"]).config["sampling_rate"]
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, log_to_driver=False)
    try:
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0)) if load.get("device") != "cpu" else 0
        dtype = _batch_dtype_name(load, gpus)
        # CPU actors leave half the CPUs to the reading tasks (all of them taken would stall the reads)
        actors = gpus * actors_per_gpu or max(1, min(cpu_actors, int(resources.get("CPU", 2)) // 2))
        calls = CALLS_PER_GPU_ACTOR if gpus else CALLS_PER_CPU_ACTOR
        data = ray.data.from_items([{"shard": n} for n in todo], override_num_blocks=len(todo))
        data = data.map(_read_shard, fn_kwargs={"shards": shards, "rate": rate, "dtype": dtype}, num_cpus=1)
        data = data.map(_EncodeShard, fn_constructor_kwargs={"load": load, "settings": settings, "dtype": dtype},
                        compute=ActorPoolStrategy(size=actors, max_concurrent_calls_per_actor=calls),
                        num_gpus=1 / actors_per_gpu if gpus else 0,
                        num_cpus=_gpu_actor_cpus(resources.get("CPU", 0), actors) if gpus else 1)
        return data.take_all()
    finally:
        if started:
            ray.shutdown()
