"""The Ray Data engine of encode_dataset (``engine='ray'``): shards read and batched by CPU tasks,
encoded by actors (one per GPU), written by CPU tasks.

A GPU actor does only what needs its GPU: it uploads a shard's batches, launches their encodes and
fetches the codes. Everything else runs in CPU tasks around it. A reading task decodes its shard's
files and lays the batches out (each clip zero-padded to its batch's length, in the dtype the
encoder takes) as one flat array, which Ray keeps in its object store and the actor reads in place;
a writing task cuts the codes into rows and writes the Parquet shard. (The first version pickled
the clips and an actor batched and wrote its shards itself: on an H100 the actor's host work per
256-file shard matched the GPU's encode, and the engine ran at 0.41, then 0.77, of the local one;
docs/datasets.md.) Each GPU actor takes two shards at a time, so that one shard's upload and code
fetch overlap the other's encode.
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings

import numpy as np

from snac_fast.datasets.batching import Batch, finish_batches, launch_batches, length_batches, padded_length
from snac_fast.datasets.encode import write_codes
from snac_fast.datasets.inputs import read_clip
from snac_fast.datasets.runs import _load, _model_name

# shards an actor holds at once: on a GPU one encoding while the other is uploaded or fetched; a
# CPU actor's encode is its own host work
CALLS_PER_GPU_ACTOR = 2
CALLS_PER_CPU_ACTOR = 1


def _read_shard(row: dict, shards: list, config: dict, dtype: str, settings: dict) -> dict:
    """A Ray task: read one shard's files and lay out its batches (CPU). Returns the shard's index,
    its batches' rows end to end (``dtype``, 1-D: batch by batch, each [rows, padded length]
    row-major, zero-padded) and, pickled, the clips without their samples, each clip's length in
    samples (0: unreadable) and the batches' clip indices."""
    clips = [read_clip(item, config["sampling_rate"]) for item in shards[row["shard"]]]
    pad = settings["pad_seconds"]
    batches = length_batches(clips, config, pad, settings["batch_seconds"])
    lengths = [padded_length(clips[b[0]].audio.size, config, pad) for b in batches]
    audio = np.zeros(sum(len(b) * n for b, n in zip(batches, lengths)), dtype)
    at = 0
    for batch, length in zip(batches, lengths):
        rows = audio[at:at + len(batch) * length].reshape(len(batch), length)
        for r, i in enumerate(batch):
            rows[r, :clips[i].audio.size] = clips[i].audio  # rounded to dtype as batch_audio rounds
        at += len(batch) * length
    samples = [0 if c.audio is None else c.audio.size for c in clips]
    records = [dataclasses.replace(c, audio=None) for c in clips]
    return {"shard": row["shard"], "audio": audio, "plan": pickle.dumps((records, samples, batches, lengths))}


class _EncodeShard:
    """A Ray actor: one FastSNAC; a shard's batches in, its codes out."""

    def __init__(self, load: dict, dtype: str) -> None:
        from snac_fast.datasets.batching import _batch_dtype

        self.codec = _load(**load)
        made = str(_batch_dtype(self.codec)).replace("torch.", "")
        if made != dtype:  # the readers' samples would be converted again, or rounded differently
            raise RuntimeError(f"the reading tasks made {dtype} samples, the codec batches {made}")

    def __call__(self, row: dict) -> dict:
        import torch

        records, samples, batches, lengths = pickle.loads(row["plan"])
        audio, at, launched = np.asarray(row["audio"]), 0, []
        with warnings.catch_warnings():  # Ray's arrays are read-only; the encode only reads them
            warnings.simplefilter("ignore", UserWarning)
            for batch, length in zip(batches, lengths):
                rows = torch.from_numpy(audio[at:at + len(batch) * length].reshape(len(batch), 1, length))
                launched.append(Batch(batch, rows, [samples[i] for i in batch]))
                at += len(batch) * length
        codes = finish_batches(self.codec, samples, launch_batches(self.codec, launched))
        return {"shard": row["shard"], "plan": row["plan"], "codes": pickle.dumps(codes),
                "model": _model_name(self.codec), "levels": self.codec.n_levels}


def _write_shard(row: dict, settings: dict) -> dict:
    """A Ray task: write one shard's Parquet file from its actor's codes (CPU)."""
    records = pickle.loads(row["plan"])[0]
    return write_codes(records, pickle.loads(row["codes"]), int(row["shard"]), settings, row["model"], int(row["levels"]))


def _batch_dtype_name(load: dict, gpus: int) -> str:
    """The dtype the actors' codecs build batches in (``batching._batch_dtype``), known before any
    actor exists: float16 for a float16 codec, else float32."""
    import torch

    from snac_fast.api import parse_dtype

    device = torch.device(load.get("device") or ("cuda" if gpus else "cpu"))
    return "float16" if parse_dtype(load.get("dtype"), device) == torch.float16 else "float32"


def _encode_with_ray(shards, todo, load: dict, settings: dict, address: str | None, cpu_actors: int) -> list[dict]:
    try:
        import ray
        from ray.data import ActorPoolStrategy
    except ImportError as error:
        raise ImportError("engine='ray' needs Ray Data: pip install 'snac-fast[ray]'") from error
    from snac_fast.loading import resolve_checkpoint

    if not todo:
        return []
    config = resolve_checkpoint(load["model"]).config
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, log_to_driver=False)
    try:
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0)) if load.get("device") != "cpu" else 0
        dtype = _batch_dtype_name(load, gpus)
        # CPU actors leave half the CPUs to the reading tasks (all of them taken would stall the reads)
        actors = gpus or max(1, min(cpu_actors, int(resources.get("CPU", 2)) // 2))
        calls = CALLS_PER_GPU_ACTOR if gpus else CALLS_PER_CPU_ACTOR
        data = ray.data.from_items([{"shard": n} for n in todo], override_num_blocks=len(todo))
        data = data.map(_read_shard, fn_kwargs={"shards": shards, "config": config, "dtype": dtype, "settings": settings},
                        num_cpus=1)
        data = data.map(_EncodeShard, fn_constructor_kwargs={"load": load, "dtype": dtype},
                        compute=ActorPoolStrategy(size=actors, max_concurrent_calls_per_actor=calls),
                        num_gpus=1 if gpus else 0, num_cpus=0 if gpus else 1)
        data = data.map(_write_shard, fn_kwargs={"settings": settings}, num_cpus=1)
        return data.take_all()
    finally:
        if started:
            ray.shutdown()
