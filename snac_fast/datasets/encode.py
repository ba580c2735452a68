"""encode_dataset: shards encoded back to back on one codec (or through Ray)."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import queue
import signal
import time
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from snac_fast.configs import DEFAULT_MODEL
from snac_fast.datasets.batching import (
    LaunchedShard,
    _batch_dtype,
    Batch,
    batch_audio,
    finish_clips,
    launch_batches,
    launch_clips,
)
from snac_fast.datasets.inputs import Clip, list_inputs
from snac_fast.datasets.readers import READ_AHEAD, _Readers
from snac_fast.datasets.runs import _load, _model_name, _progress
from snac_fast.datasets.shards import (
    _check_run,
    _require_pyarrow,
    _write_atomically,
    shard_name,
    shard_table,
)


def encode_dataset(source: str | Path, out: str | Path, codec=None, *, model: str | None = None,
                   engine: str = "local", address: str | None = None, model_options: dict | None = None,
                   files_per_shard: int = 256, batch_seconds: float = 300.0, pad_seconds: float = 1.0,
                   suffixes: Sequence[str] | None = None, loaders: int | None = None, progress: bool = True,
                   device: str | None = None, dtype: str | None = None, actors_per_gpu: int = 3,
                   launchers: int = 1) -> dict:
    """Encode every input of ``source`` (see :func:`list_inputs`) into Parquet shards in ``out``
    (see the module docstring). Returns a summary: files, shards written and skipped, seconds of
    audio, errors, wall seconds, and ``per_shard``: each shard written (index, audio seconds,
    errors, ``finished_at`` as ``time.time()``).

    engine "local": this process encodes with ``codec`` (a FastSNAC; default: ``model`` loaded by
    ``FastSNAC.from_pretrained(model, device=, dtype=, **model_options)``); with ``launchers`` > 1,
    that many processes share the shards on its device, the others spawned and each loading
    ``model`` itself (pass model=, not a codec), joining as soon as they are ready. engine "ray" (needs
    ``pip install 'snac-fast[ray]'``): Ray Data reads each shard's audio in CPU tasks and encodes
    it in actors (``actors_per_gpu`` per GPU of the cluster, each a process with its share of the GPU
    and two CPUs reserved: several interpreters launch one GPU's encodes, where one alone leaves it
    waiting; else up to ``loaders`` CPU actors), each loading ``model`` itself; ``address`` joins a
    running cluster, else a local one is started. Both engines write the same shards."""
    if engine not in ("local", "ray"):
        raise ValueError(f"engine must be 'local' or 'ray', got {engine!r}")
    _require_pyarrow()
    loaders = loaders or min(16, os.cpu_count() or 1)
    if files_per_shard < 1 or batch_seconds <= 0 or pad_seconds < 0 or min(loaders, actors_per_gpu, launchers) < 1:
        raise ValueError("files_per_shard, loaders, actors_per_gpu and launchers must be >= 1, batch_seconds > 0 "
                         "and pad_seconds >= 0")
    if launchers > 1 and (engine != "local" or codec is not None):
        raise ValueError("launchers > 1 is for engine='local' with model= (each process loads it), not a codec")
    inputs = list_inputs(source, suffixes)
    load = {"model": str(model or DEFAULT_MODEL), "device": device, "dtype": dtype, **(model_options or {})}
    if engine == "ray":
        if codec is not None:
            raise ValueError("engine='ray' loads the model in its actors: pass model=, not a codec")
        name = load["model"]
    else:
        codec = codec if codec is not None else _load(**load)
        name = _model_name(codec)
    out = Path(out)
    ids = hashlib.sha256("\n".join(i.id for i in inputs).encode()).hexdigest()
    _check_run(out, {"model": name, "inputs": len(inputs), "ids_sha256": ids, "files_per_shard": files_per_shard,
                     "pad_seconds": pad_seconds})
    shards = [inputs[k:k + files_per_shard] for k in range(0, len(inputs), files_per_shard)]
    todo = [n for n in range(len(shards)) if not (out / shard_name(n)).exists()]
    start = time.perf_counter()
    settings = {"out": str(out), "pad_seconds": pad_seconds, "batch_seconds": batch_seconds}
    if engine == "ray":
        from snac_fast.datasets.ray_engine import (
            _encode_with_ray,  # its actors run encode_shard of this module
        )

        done = _encode_with_ray(shards, todo, load, settings, address, loaders, actors_per_gpu)
    else:
        done = _encode_local(shards, todo, codec, load, settings, loaders, launchers, progress, start)
    return {"files": len(inputs), "shards": len(shards), "shards_skipped": len(shards) - len(todo),
            "audio_seconds": sum(d["audio_seconds"] for d in done), "errors": sum(d["errors"] for d in done),
            "wall_seconds": time.perf_counter() - start, "per_shard": done}


def encode_shard(codec, clips: Sequence[Clip], index: int, settings: dict) -> dict:
    """Encode one shard's clips and write its file; returns what it held (audio seconds, errors)."""
    launched = launch_clips(codec, clips, settings["pad_seconds"], settings["batch_seconds"])
    return write_shard(codec, clips, finish_clips(codec, clips, launched), index, settings)


def write_shard(codec, clips: Sequence[Clip], codes: Sequence[list[np.ndarray] | None], index: int, settings: dict) -> dict:
    """Write one shard's file; returns what it held (audio seconds, errors)."""
    table = shard_table(clips, codes, _model_name(codec), codec.n_levels)
    _write_atomically(table, Path(settings["out"]) / shard_name(index))
    return {"shard": index, "audio_seconds": sum(c.duration or 0.0 for c in clips),
            "errors": sum(c.error is not None for c in clips), "finished_at": time.time()}


def encode_back_to_back(codec, shards: Iterable[tuple[int, list[Clip]]], pad_seconds: float,
                        batch_seconds: float) -> Iterator[tuple[int, list[Clip], list[list[np.ndarray] | None]]]:
    """(index, clips, codes) of each (index, clips) shard, in order: each shard's batches are queued
    on the device before the previous shard's codes are fetched, so that host work between shards
    (reading, fetching, writing) overlaps the device's."""
    previous = None
    for index, clips in shards:
        launched = launch_clips(codec, clips, pad_seconds, batch_seconds)
        if previous is not None:
            yield previous[0], previous[1], finish_clips(codec, previous[1], previous[2])
        previous = (index, clips, launched)
    if previous is not None:
        yield previous[0], previous[1], finish_clips(codec, previous[1], previous[2])


def _encode_local(shards, todo, codec, load: dict, settings: dict, loaders: int, launchers: int, progress: bool,
                  start: float) -> list[dict]:
    """The local engine: this process, and ``launchers - 1`` helper processes once they have loaded
    the model, claim the shards in order (a shared counter) and encode them on one device: each
    process's interpreter launches its own encodes, where one alone leaves the GPU waiting (the Ray
    engine's three actors per GPU ran 253 h/min where one process ran 222-258, docs/datasets.md).
    Shards a helper claimed but did not report (it failed or died) are encoded here after."""
    done: list[dict] = []
    with _progress(sum(len(shards[n]) for n in todo), progress) as bar:
        def written(summary: dict) -> None:
            done.append(summary)
            bar.update(len(shards[summary["shard"]]))
            hours = sum(d["audio_seconds"] for d in done) / 3600
            bar.set_postfix_str(f"{hours / (time.perf_counter() - start):.4f} h audio/s")

        if launchers == 1 or len(todo) < 2:
            _encode_here(shards, todo, _Claims(len(todo)), codec, settings, loaders, written)
            return done
        context = multiprocessing.get_context("spawn")  # fresh interpreters: no CUDA state forked
        claims = _Claims(len(todo), context.Value("q", 0))
        reports = context.Queue()
        loading = context.Array("b", [1] * (launchers - 1), lock=False)  # cleared once a helper's model is loaded
        share = max(1, loaders // launchers)
        # not daemonic: a helper starts its own reader processes
        helpers = [context.Process(target=_launch_helper, name=f"snac-fast-launcher-{i}",
                                   args=(i, shards, todo, claims, reports, loading, load, settings, share))
                   for i in range(launchers - 1)]
        for helper in helpers:
            helper.start()
        ended: set[int] = set()
        failures: list[str] = []

        def collect(timeout: float = 0.0) -> None:
            """The helpers' reports so far (waiting up to ``timeout`` for the first)."""
            while True:
                try:
                    kind, who, value = reports.get(timeout=timeout) if timeout else reports.get_nowait()
                except queue.Empty:
                    return
                if kind == "shard":
                    written(value)
                else:
                    ended.add(who)
                    failures.extend([value] if value else [])
                timeout = 0.0

        try:
            _encode_here(shards, todo, claims, codec, settings, max(1, loaders - share * len(helpers)),
                         lambda summary: (written(summary), collect()))
            # every shard is claimed: a helper still loading its model gets none, and has not touched
            # the queue (a helper writes to it only once it holds a claim), so it can be stopped
            for i, helper in enumerate(helpers):
                if loading[i]:
                    helper.terminate()
            while any(helper.is_alive() for i, helper in enumerate(helpers) if i not in ended):
                collect(timeout=1.0)
            collect()
        finally:
            for helper in helpers:
                helper.join(timeout=5)
                if helper.is_alive():
                    helper.terminate()
        for i, helper in enumerate(helpers):
            if loading[i] and helper.exitcode not in (0, -signal.SIGTERM):
                warnings.warn(f"encode_dataset: {helper.name} could not load the model (exit code {helper.exitcode}; "
                              "its traceback is above): this process encoded its share", RuntimeWarning, stacklevel=3)
        left = [n for n in todo if n not in {d["shard"] for d in done}]
        if left:  # claimed by a helper that failed or died: encoded here instead, nothing lost
            why = failures[0] if failures else "it stopped without reporting them"
            warnings.warn(f"encode_dataset: {len(left)} shard(s) of a helper launching process are encoded in the "
                          f"main process instead ({why})", RuntimeWarning, stacklevel=3)
            _encode_here(shards, left, _Claims(len(left)), codec, settings, loaders, written)
    return done


class _Claims:
    """Positions 0, 1, ... of the shards to encode, each handed out once to whichever launching
    process asks first (a shared counter across processes, or a plain one in this process)."""

    def __init__(self, count: int, shared=None) -> None:
        self.count, self.shared, self.next = count, shared, 0

    def __call__(self) -> int | None:
        if self.shared is None:
            k, self.next = self.next, self.next + 1
        else:
            with self.shared.get_lock():
                k = self.shared.value
                self.shared.value = k + 1
        return k if k < self.count else None


def _launch_helper(who: int, shards, todo, claims: _Claims, reports, loading, load: dict, settings: dict,
                   loaders: int) -> None:
    """A helper launching process (spawned): load the model, then encode the shards it claims,
    reporting each one written and, if it claimed any, its end (None, or why it failed). It writes
    nothing to ``reports`` before its first claim: until then it may be stopped at any point."""
    codec = _load(**load)  # a failure here is its traceback on stderr: it held no claim
    loading[who] = 0
    held = []

    def claim() -> int | None:
        k = claims()
        held.extend([] if k is None else [k])
        return k

    try:
        _encode_here(shards, todo, claim, codec, settings, loaders, lambda summary: reports.put(("shard", who, summary)))
    except BaseException as error:  # noqa: BLE001 - reported: the main process encodes what is left
        if held:
            reports.put(("end", who, f"{type(error).__name__}: {error}"))
        raise
    if held:
        reports.put(("end", who, None))


def _encode_here(shards, todo, claim: Callable[[], int | None], codec, settings, loaders, written: Callable[[dict], None]) -> None:
    """One launching process's loop. This thread only launches encodes; one helper thread collects
    each claimed shard's audio from the reader processes (reading ``READ_AHEAD`` claimed shards
    ahead) and builds its pinned batches, another fetches the codes and writes the shard. With all
    of that in it, the launching thread was the bottleneck (docs/measurements.md); in one thread
    altogether it ran slower still (docs/datasets.md). ``written`` gets each shard's summary."""
    pad, per_batch = settings["pad_seconds"], settings["batch_seconds"]
    with _Readers(loaders, codec.sampling_rate, _batch_dtype(codec)) as readers, \
            ThreadPoolExecutor(1, "snac-fast-batches") as batcher, ThreadPoolExecutor(1, "snac-fast-writer") as writer:
        reads: deque[tuple[int, list[Future]]] = deque()

        def read_next() -> None:
            k = claim()
            if k is not None:
                reads.append((todo[k], readers.submit(shards[todo[k]])))

        def prepare() -> tuple[int, list[Clip], list[Batch]]:
            n, futures = reads.popleft()
            clips = readers.collect(shards[n], futures)
            read_next()  # the readers never wait for this thread
            return n, clips, batch_audio(codec, clips, pad, per_batch)

        def finish(n: int, clips: list[Clip], launched: LaunchedShard) -> dict:
            return write_shard(codec, clips, finish_clips(codec, clips, launched), n, settings)

        for _ in range(READ_AHEAD):
            read_next()
        prepared = batcher.submit(prepare) if reads else None
        writes: list[Future] = []
        while prepared is not None:
            n, clips, batches = prepared.result()
            prepared = batcher.submit(prepare) if reads else None  # reads: only prepare changes it, and it is done
            writes.append(writer.submit(finish, n, clips, launch_batches(codec, batches)))
            while len(writes) > 1 or (writes and writes[0].done()):  # at most two shards in flight
                written(writes.pop(0).result())
        for future in writes:
            written(future.result())
