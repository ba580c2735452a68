"""Corpus-scale encoding and decoding: audio files -> Parquet shards of SNAC codes, and back.

``encode_dataset(source, out)`` reads a folder of audio files (recursive), a text list of paths, or
a Parquet/JSONL manifest (a ``path`` or ``audio`` bytes column, optional ``id``), and writes
``out/shard-00000.parquet``, ... with one row per input: ``id``, ``path``, ``duration`` (seconds),
``sampling_rate`` (the file's), ``model``, ``codes_0`` ... ``codes_{n-1}`` (one int16 list per
level) and ``error`` (null, or why the file could not be encoded: its codes are then null). Nothing
is skipped silently: an empty, corrupt or non-audio file is a row with its error.

- Inputs are sorted by id and cut into shards of ``files_per_shard``; a finished shard is written
  atomically and skipped when the run is repeated, so a crashed run resumes where it stopped
  (``out/_run.json`` records the run's inputs and settings; another run into ``out`` is refused).
- Audio is read (soundfile), mixed down to mono and resampled to the model's rate in ``loaders``
  worker processes (default: one per CPU, up to 16) at the lowest CPU priority, two shards ahead
  of the GPU. Processes, not threads: reading threads keep this process's GIL busy, and the thread
  that launches the encoder's kernels then waits for it at every launch (an encode ran 15-27x
  slower beside 16 reading threads).
  A reader process that dies (a crash in the audio library) costs only the file it was reading:
  that shard is read again one file at a time, and the culprit gets an error row.
- Clips are batched by length: each clip is zero-padded to the next multiple of ``pad_seconds``
  (rounded to the model's padding unit), clips of one padded length are encoded together up to
  ``batch_seconds`` of audio per batch, and each clip's codes are cut to its own length. A clip's
  codes therefore depend on the clip and ``pad_seconds`` only, never on its batch mates; with
  ``pad_seconds=0`` they equal ``codec.encode`` of the clip alone.

``decode_dataset(source, out)`` turns such shards back into audio files (WAV or FLAC, one per row,
named by id) or Parquet shards with an ``audio`` column, skipping rows with an error (listed in
``out/_errors.jsonl``) and files already written.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import math
import mmap
import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from snac_fast.codes import read_mono
from snac_fast.configs import DEFAULT_MODEL
from snac_fast.encoding import padding_unit

MANIFEST_SUFFIXES = (".parquet", ".jsonl")
LIST_SUFFIXES = (".txt", ".lst")
# shards being read ahead of the one being batched: with one, the readers sat idle while the
# previous shard was collected and batched (H100: ~150 ms per 256-file shard, GPU ~105)
READ_AHEAD = 2


@dataclass(frozen=True)
class AudioInput:
    """One input: its id (unique), where it comes from (a path, or bytes from a manifest)."""

    id: str
    path: str | None = None
    data: bytes | None = None


@dataclass
class Clip:
    """An input read for encoding: mono float32 samples at the model's rate, or the error."""

    input: AudioInput
    audio: np.ndarray | None
    duration: float | None
    sampling_rate: int | None
    error: str | None


def list_inputs(source: str | Path, suffixes: Sequence[str] | None = None) -> list[AudioInput]:
    """The inputs ``source`` names, sorted by id. A folder: every file under it (hidden ones and
    those not ending in one of ``suffixes`` excepted), id = its path relative to the folder. A
    .txt/.lst file: one path per line (ids: the paths). A .parquet/.jsonl manifest: a ``path`` or
    ``audio`` (bytes) column and an optional ``id`` column (default: the path, or the row number)."""
    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist")
    if source.is_dir():
        keep = tuple(s.lower() for s in suffixes) if suffixes else None
        inputs = [AudioInput(id, path) for id, path in _files_under(str(source), "")
                  if keep is None or os.path.splitext(id)[1].lower() in keep]
    elif source.suffix.lower() in LIST_SUFFIXES:
        lines = [line.strip() for line in source.read_text().splitlines()]
        inputs = [AudioInput(line, line) for line in lines if line and not line.startswith("#")]
    elif source.suffix.lower() in MANIFEST_SUFFIXES:
        inputs = _manifest_inputs(source)
    else:
        raise ValueError(f"{source}: expected a folder, a .txt/.lst list of paths or a .parquet/.jsonl manifest")
    repeated = [id for id, n in Counter(i.id for i in inputs).items() if n > 1]
    if repeated:
        raise ValueError(f"{source}: id {repeated[0]!r} appears more than once; ids must be unique")
    return sorted(inputs, key=lambda i: i.id)


def _files_under(folder: str, prefix: str) -> Iterator[tuple[str, str]]:
    """(id: the path relative to the walk's root, path) of every non-hidden file under ``folder``,
    hidden folders skipped (os.scandir: rglob and relative_to took ~0.25 ms a file under cProfile)."""
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.is_dir(follow_symlinks=False):  # as rglob: linked folders are not entered
                yield from _files_under(entry.path, prefix + entry.name + "/")
            elif entry.is_file():
                yield prefix + entry.name, entry.path


def _manifest_inputs(source: Path) -> list[AudioInput]:
    if source.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(source).to_pylist()
    else:
        rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    inputs = []
    for n, row in enumerate(rows):
        path, data = row.get("path"), row.get("audio")
        if path is None and data is None:
            raise ValueError(f"{source}: row {n} has neither a 'path' nor an 'audio' column")
        if isinstance(data, dict):  # Hugging Face datasets' Audio feature: {"bytes": ..., "path": ...}
            path, data = path or data.get("path"), data.get("bytes")
        if path is not None and not Path(path).is_absolute():
            path = str(source.parent / path)
        inputs.append(AudioInput(str(row.get("id", path if data is None else n)), path if data is None else None, data))
    return inputs


def read_clip(item: AudioInput, rate: int) -> Clip:
    """Read one input as mono float32 at ``rate``; any failure becomes the clip's error."""
    import torchaudio.functional as AF

    try:
        mono, source_rate = read_mono(item.path if item.data is None else io.BytesIO(item.data))
        duration = mono.numel() / source_rate
        if source_rate != rate:
            mono = AF.resample(mono, orig_freq=source_rate, new_freq=rate)
        return Clip(item, mono.numpy(), duration, source_rate, None)
    except Exception as error:  # noqa: BLE001 - recorded in the row: a corpus run goes on
        return Clip(item, None, None, None, f"{type(error).__name__}: {error}")


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


def batch_audio(codec, clips: Sequence[Clip], pad_seconds: float, batch_seconds: float) -> list[tuple[list[int], Tensor]]:
    """The readable clips in batches (see :func:`length_batches`): (clip indices, audio [rows, 1,
    padded length] on the host, pinned when the codec runs on a GPU, zero-padded)."""
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
        batches.append((batch, audio))
    return batches


def launch_batches(codec, batches: list[tuple[list[int], Tensor]]) -> LaunchedShard:
    """Queue the encode of :func:`batch_audio`'s batches, and the copy of their codes to the host,
    without waiting for either; :func:`finish_clips` collects them."""
    cuda = codec.device.type == "cuda"
    launched = []
    for batch, audio in batches:
        # no CUDA graphs: a corpus brings ever-new batch shapes, each capture costs about three encodes;
        # read_clip checked the samples already (on the GPU, that scan would wait for the queued batches)
        codes = codec.encode(audio.to(codec.device, non_blocking=True), cuda_graphs=False, check_finite=False)
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


def shard_table(clips: Sequence[Clip], codes: Sequence[list[np.ndarray] | None], model: str, levels: int):
    """A pyarrow Table of one shard: a row per clip, in order."""
    import pyarrow as pa

    columns = {
        "id": pa.array([c.input.id for c in clips], pa.string()),
        "path": pa.array([c.input.path for c in clips], pa.string()),
        "duration": pa.array([c.duration for c in clips], pa.float64()),
        "sampling_rate": pa.array([c.sampling_rate for c in clips], pa.int32()),
        "model": pa.array([model] * len(clips), pa.string()),
    }
    for level in range(levels):
        columns[f"codes_{level}"] = pa.array([None if c is None else c[level] for c in codes], pa.list_(pa.int16()))
    columns["error"] = pa.array([c.error for c in clips], pa.string())
    return pa.table(columns)


def _write_atomically(table, path: Path) -> None:
    import pyarrow.parquet as pq

    partial = path.with_name(path.name + ".partial")
    pq.write_table(table, partial)
    os.replace(partial, path)  # a crash leaves no half shard that a resumed run would trust


def _check_run(out: Path, settings: dict) -> None:
    """Record this run's settings in out/_run.json, or refuse a different run into the same folder."""
    record = out / "_run.json"
    if record.exists():
        before = json.loads(record.read_text())
        if before != settings:
            changed = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
            raise ValueError(f"{out} holds shards of a different run ({', '.join(changed)} differ): use a new folder")
    else:
        out.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(settings, indent=2) + "\n")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.parquet"


def _require_pyarrow() -> None:
    """ImportError naming the extra, at the start of a dataset job rather than at its first shard."""
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ImportError("datasets need pyarrow: pip install 'snac-fast[datasets]'") from None


def encode_dataset(source: str | Path, out: str | Path, codec=None, *, model: str | None = None,
                   engine: str = "local", address: str | None = None, model_options: dict | None = None,
                   files_per_shard: int = 256, batch_seconds: float = 300.0, pad_seconds: float = 1.0,
                   suffixes: Sequence[str] | None = None, loaders: int | None = None, progress: bool = True,
                   device: str | None = None, dtype: str | None = None) -> dict:
    """Encode every input of ``source`` (see :func:`list_inputs`) into Parquet shards in ``out``
    (see the module docstring). Returns a summary: files, shards written and skipped, seconds of
    audio, errors, wall seconds, and ``per_shard``: each shard written (index, audio seconds,
    errors, ``finished_at`` as ``time.time()``).

    engine "local": this process encodes with ``codec`` (a FastSNAC; default: ``model`` loaded by
    ``FastSNAC.from_pretrained(model, device=, dtype=, **model_options)``). engine "ray" (needs
    ``pip install 'snac-fast[ray]'``): Ray Data reads each shard's audio in CPU tasks and encodes
    it in actors (one per GPU of the cluster, else up to ``loaders`` CPU actors), each loading ``model``
    itself; ``address`` joins a running cluster, else a local one is started. Both engines write
    the same shards."""
    if engine not in ("local", "ray"):
        raise ValueError(f"engine must be 'local' or 'ray', got {engine!r}")
    _require_pyarrow()
    loaders = loaders or min(16, os.cpu_count() or 1)
    if files_per_shard < 1 or batch_seconds <= 0 or pad_seconds < 0 or loaders < 1:
        raise ValueError("files_per_shard and loaders must be >= 1, batch_seconds > 0 and pad_seconds >= 0")
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
        done = _encode_with_ray(shards, todo, load, settings, address, loaders)
    else:
        done = _encode_here(shards, todo, codec, settings, loaders, progress, start)
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


def _encode_here(shards, todo, codec, settings, loaders, progress, start) -> list[dict]:
    """The local engine. This thread only launches encodes; one helper thread collects each
    shard's audio from the reader processes (reading ``READ_AHEAD`` shards ahead) and builds its
    pinned batches, another fetches the codes and writes the shard. On a 16-CPU H100 host the
    launching thread was the bottleneck with all of that in it: ~175 ms per 256-file shard against
    ~105 ms of GPU work (docs/datasets.md)."""
    done: list[dict] = []
    pad, per_batch = settings["pad_seconds"], settings["batch_seconds"]
    with _Readers(loaders, codec.sampling_rate, _batch_dtype(codec)) as readers, \
            _progress(sum(len(shards[n]) for n in todo), progress) as bar, \
            ThreadPoolExecutor(1, "snac-fast-batches") as batcher, ThreadPoolExecutor(1, "snac-fast-writer") as writer:
        reads = {}

        def read(k: int) -> None:
            if k < len(todo):
                reads[k] = readers.submit(shards[todo[k]])

        def prepare(k: int) -> tuple[list[Clip], list[tuple[list[int], Tensor]]]:
            clips = readers.collect(shards[todo[k]], reads.pop(k))
            read(k + READ_AHEAD)  # the readers never wait for this thread
            return clips, batch_audio(codec, clips, pad, per_batch)

        def finish(n: int, clips: list[Clip], launched: LaunchedShard) -> dict:
            return write_shard(codec, clips, finish_clips(codec, clips, launched), n, settings)

        def written(future: Future) -> None:
            done.append(future.result())
            bar.update(len(shards[done[-1]["shard"]]))
            hours = sum(d["audio_seconds"] for d in done) / 3600
            bar.set_postfix_str(f"{hours / (time.perf_counter() - start):.4f} h audio/s")

        for k in range(READ_AHEAD):
            read(k)
        if todo:
            prepared = batcher.submit(prepare, 0)
        writes: list[Future] = []
        for k, n in enumerate(todo):
            clips, batches = prepared.result()
            if k + 1 < len(todo):
                prepared = batcher.submit(prepare, k + 1)
            writes.append(writer.submit(finish, n, clips, launch_batches(codec, batches)))
            while len(writes) > 1 or (writes and writes[0].done()):  # at most two shards in flight
                written(writes.pop(0))
        for future in writes:
            written(future)
    return done


def _read_clips(items: list[AudioInput], rate: int, dtype: str, spool: str) -> tuple[str | None, list[tuple]]:
    """A reader process's task: the items' audio (as ``dtype``) written one after another into a
    new file in ``spool``, and (samples, duration, sampling rate, error) per item. If the spool
    cannot take the file, the arrays come back themselves (path None)."""
    clips = [read_clip(item, rate) for item in items]
    arrays = [None if c.audio is None else c.audio.astype(dtype, copy=False) for c in clips]
    meta = [(None if a is None else a.size, c.duration, c.sampling_rate, c.error) for a, c in zip(arrays, clips)]
    try:
        fd, path = tempfile.mkstemp(dir=spool)
        with os.fdopen(fd, "wb") as f:
            for a in arrays:
                if a is not None:
                    f.write(memoryview(a))
        return path, meta
    except OSError:
        return None, [(a, *m[1:]) for a, m in zip(arrays, meta)]


def _map_read_only(fd: int, size: int) -> mmap.mmap:
    if not hasattr(mmap, "MAP_SHARED"):  # Windows
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    # populated in the call: no page fault per 4 KB later, in the thread that launches kernels
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)


def _start_reader() -> None:
    torch.set_num_threads(1)  # one reader per core; and no OpenMP pool inherited across fork
    try:
        # the lowest priority: beside 16 busy readers on a 16-CPU H100 host, the launching thread
        # took 177 ms of CPU per 256-file shard at the default priority, 87 ms at this one (68 idle)
        os.nice(19)
    except (AttributeError, OSError):  # no os.nice (Windows), or not permitted
        pass


class _Readers:
    """Worker processes reading audio (see the module docstring), a shard's files in small tasks.

    A task's audio comes back through a file in a spool folder on /dev/shm (memory), which this
    process maps: through the pool's pipe, its result thread spent about as long unpickling 2 GB
    of audio as the encode took, holding the GIL the launching thread needs. Audio is sent in the
    dtype batches are built in (float16 for a float16 codec: half the bytes)."""

    def __init__(self, processes: int, rate: int, dtype: torch.dtype = torch.float32) -> None:
        """dtype: the audio's on the way back (:func:`_batch_dtype`)."""
        self.processes, self.rate = processes, rate
        self.dtype = torch.empty(0, dtype=dtype).numpy().dtype.name
        # fork: no re-import of torch per worker; the children never touch CUDA
        self.context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        for module in ("soundfile", "torchaudio.functional"):  # imported once here, not in every forked reader
            importlib.import_module(module)
        shm = Path("/dev/shm")
        self.spool = tempfile.mkdtemp(prefix="snac-fast-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None)
        self.pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.processes, mp_context=self.context, initializer=_start_reader)

    def __enter__(self) -> "_Readers":
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.spool, ignore_errors=True)

    def _submit(self, items: list[AudioInput]) -> Future:
        return self.pool.submit(_read_clips, items, self.rate, self.dtype, self.spool)

    def submit(self, items: list[AudioInput]) -> list[Future]:
        # two tasks per reader and shard: every task costs this process's threads some GIL time
        size = max(1, min(16, len(items) // (2 * self.processes)))
        try:
            return [self._submit(items[k:k + size]) for k in range(0, len(items), size)]
        except BrokenProcessPool:
            return []  # collect reads them one by one

    def collect(self, items: list[AudioInput], futures: list[Future]) -> list[Clip]:
        """The clips of ``items`` (read by the tasks ``submit`` returned for them)."""
        try:
            if futures:
                results = [self._unpack(*f.result()) for f in futures]
                return [Clip(item, *r) for item, r in zip(items, (r for rs in results for r in rs))]
        except BrokenProcessPool:
            pass
        self._restart()  # a reader died: this shard again, one file per task, to pin the crash on its file
        return [self._read_alone(item) for item in items]

    def _unpack(self, path: str | None, meta: list[tuple]) -> list[tuple]:
        """A task's (audio, duration, sampling rate, error) per item: views of its spool file,
        mapped read-only (the views keep the mapping; the file is unlinked at once)."""
        if path is None:
            return meta
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = _map_read_only(f.fileno(), size) if size else b""
        os.unlink(path)
        out, offset = [], 0
        for samples, *rest in meta:
            audio = None if samples is None else np.frombuffer(data, self.dtype, samples, offset)
            offset += 0 if samples is None else audio.nbytes
            out.append((audio, *rest))
        return out

    def _read_alone(self, item: AudioInput) -> Clip:
        try:
            return Clip(item, *self._unpack(*self._submit([item]).result())[0])
        except BrokenProcessPool:
            self._restart()
            return Clip(item, None, None, None, "the reader process died reading this file (a crash in the audio library)")

    def _restart(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.pool = self._new_pool()


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


def read_shards(source: str | Path) -> Iterator[dict]:
    """The rows of a Parquet shard file or of every ``*.parquet`` in a folder, in file order."""
    import pyarrow.parquet as pq

    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist")
    files = sorted(source.glob("*.parquet")) if source.is_dir() else [source]
    if not files:
        raise ValueError(f"{source}: no .parquet files")
    for file in files:
        yield from pq.read_table(file).to_pylist()


def decode_dataset(source: str | Path, out: str | Path, codec=None, *, model: str | None = None,
                   model_options: dict | None = None, format: str = "wav", seed: int = 0, rows_per_shard: int = 256, progress: bool = True,
                   device: str | None = None, dtype: str | None = None) -> dict:
    """Decode the code shards of ``source`` (a shard file or a folder of them) with ``codec``
    (default: the model named in the shards, or ``model``, loaded with ``model_options``). ``format`` "wav"/"flac": one file per
    row named after its source, ``out/<id with its extension replaced>`` (``a.wav`` -> ``a.flac``; a
    leading '/' and '..' dropped; ids that would share a name keep theirs and add the extension);
    "parquet": shards with ``id``, ``sampling_rate`` and ``audio`` (float32 list). The audio is cut to
    the source's duration (the codes cover whole frames). Noise is seeded with ``seed`` for every row
    (each decoded alone: the audio of a row does not depend on the others). Rows with an error (at
    encode, or a decode that fails) are listed in ``out/_errors.jsonl`` and the run goes on.
    Returns a summary: rows, written, skipped (already there), errors, wall seconds."""
    if format not in ("wav", "flac", "parquet"):
        raise ValueError(f"format must be wav, flac or parquet, got {format!r}")
    _require_pyarrow()
    rows = list(read_shards(source))
    names = {r.get("model") for r in rows if r.get("error") is None}
    if codec is None:
        if model is None and len(names) > 1:
            raise ValueError(f"{source} mixes models {sorted(names)}: pass model=")
        codec = _load(model or next(iter(names), None), device, dtype, **(model_options or {}))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    levels = codec.n_levels
    summary = {"rows": len(rows), "written": 0, "skipped": 0, "errors": 0}
    start = time.perf_counter()
    errors, table_rows = [], []
    names = _output_names([r.get("id") for r in rows if r.get("id") is not None], format)
    with _progress(len(rows), progress) as bar:
        for n, row in enumerate(rows):
            bar.update()
            if row.get("error") is not None or any(row.get(f"codes_{i}") is None for i in range(levels)):
                errors.append({"id": row.get("id"), "error": row.get("error") or "no codes"})
                continue
            if row["id"] not in names:
                errors.append({"id": row["id"], "error": "the id names no file"})
                continue
            target = out / names[row["id"]]
            if format != "parquet" and target.exists():
                summary["skipped"] += 1
                continue
            try:
                codes = [torch.tensor(row[f"codes_{i}"], dtype=torch.int64).view(1, -1) for i in range(levels)]
                audio = codec.decode(codes, seed=seed)[0, 0].float().cpu().numpy()
                if row.get("duration"):  # the codes cover whole frames: back to the source's length
                    audio = audio[:round(row["duration"] * codec.sampling_rate)]
                if format == "parquet":
                    table_rows.append({"id": row["id"], "sampling_rate": codec.sampling_rate, "audio": audio})
                else:
                    _write_audio(target, audio, codec.sampling_rate)
            except (ValueError, RuntimeError, OSError) as e:  # one bad row: recorded, the run goes on
                errors.append({"id": row["id"], "error": f"decode failed: {e}"})
                continue
            summary["written"] += 1
    if format == "parquet":
        _write_audio_shards(table_rows, out, rows_per_shard)
    summary["errors"] = len(errors)
    (out / "_errors.jsonl").write_text("".join(json.dumps(e) + "\n" for e in errors))
    summary["wall_seconds"] = time.perf_counter() - start
    return summary


def _output_names(ids: list[str], format: str) -> dict[str, str]:
    """Each id's output file inside the output folder: its path with the extension replaced by
    ``format``'s; ids that would collide that way (``a.wav`` and ``a.flac``) keep their name and add it."""
    relative = {}
    for i in ids:
        try:
            relative[i] = _relative_name(i)
        except ValueError:  # names no file: the row is recorded as an error
            continue
    stem = {i: str(Path(name).with_suffix(f".{format}")) for i, name in relative.items()}
    count = Counter(stem.values())
    return {i: name if count[name] == 1 else f"{relative[i]}.{format}" for i, name in stem.items()}


def _relative_name(id: str) -> str:
    """``id`` as a path inside the output folder: no root, no '..' (a list's ids may be absolute paths)."""
    parts = [p for p in Path(id).parts if p not in (os.sep, "/", "..", ".")]
    if not parts:
        raise ValueError(f"id {id!r} names no file")
    return os.path.join(*parts)


def _write_audio(target: Path, audio: np.ndarray, rate: int) -> None:
    import soundfile

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    soundfile.write(str(partial), audio, rate, format=target.suffix[1:].upper(), subtype="FLOAT" if target.suffix == ".wav" else "PCM_24")
    os.replace(partial, target)


def _write_audio_shards(rows: list[dict], out: Path, rows_per_shard: int) -> None:
    import pyarrow as pa

    for n, k in enumerate(range(0, len(rows), rows_per_shard)):
        part = rows[k:k + rows_per_shard]
        table = pa.table({"id": pa.array([r["id"] for r in part], pa.string()),
                          "sampling_rate": pa.array([r["sampling_rate"] for r in part], pa.int32()),
                          "audio": pa.array([r["audio"] for r in part], pa.list_(pa.float32()))})
        _write_atomically(table, out / shard_name(n))


def _model_name(codec) -> str:
    return codec.source or "in-memory model"


def _load(model: str | None, device: str | None = None, dtype: str | None = None, **options):
    from snac_fast.api import FastSNAC

    return FastSNAC.from_pretrained(model or DEFAULT_MODEL, device=device, dtype=dtype, **options)


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="file", disable=not enabled or None, dynamic_ncols=True)

