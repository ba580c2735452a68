"""The Ray Data engine of encode_dataset (``engine='ray'``): shards read and encoded by actors."""

from __future__ import annotations

import pickle

from snac_fast.datasets.encode import encode_shard
from snac_fast.datasets.inputs import read_clip
from snac_fast.datasets.runs import _load


def _read_shard(row: dict, shards: list, rate: int) -> dict:
    """A Ray task: read one shard's audio (CPU)."""
    return {"shard": row["shard"], "clips": pickle.dumps([read_clip(item, rate) for item in shards[row["shard"]]])}


class _EncodeShard:
    """A Ray actor: one FastSNAC, encoding and writing whole shards."""

    def __init__(self, load: dict, settings: dict) -> None:
        self.codec, self.settings = _load(**load), settings

    def __call__(self, row: dict) -> dict:
        return encode_shard(self.codec, pickle.loads(row["clips"]), int(row["shard"]), self.settings)


def _encode_with_ray(shards, todo, load: dict, settings: dict, address: str | None, cpu_actors: int) -> list[dict]:
    try:
        import ray
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
        # CPU actors leave half the CPUs to the reading tasks (all of them taken would stall the reads)
        actors = gpus or max(1, min(cpu_actors, int(resources.get("CPU", 2)) // 2))
        data = ray.data.from_items([{"shard": n} for n in todo], override_num_blocks=len(todo))
        data = data.map(_read_shard, fn_kwargs={"shards": shards, "rate": rate}, num_cpus=1)
        data = data.map(_EncodeShard, fn_constructor_kwargs={"load": load, "settings": settings},
                        concurrency=actors, num_gpus=1 if gpus else 0, num_cpus=0 if gpus else 1)
        return data.take_all()
    finally:
        if started:
            ray.shutdown()
