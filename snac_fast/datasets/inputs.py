"""What a run reads: inputs listed from a folder, a list, a manifest or WebDataset tar shards, and
one clip read."""

from __future__ import annotations

import glob
import io
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from snac_fast.codes import read_mono, resample_mono

MANIFEST_SUFFIXES = (".parquet", ".jsonl")


LIST_SUFFIXES = (".txt", ".lst")
TAR_SUFFIX = ".tar"
HF_PREFIX = "hf:"  # hf:NAME[@SPLIT]: a dataset through datasets.load_dataset
AUDIO_COLUMN = "audio"
# a WebDataset sample's audio member, by preference when a sample has several
AUDIO_MEMBERS = ("flac", "wav", "mp3", "opus", "ogg")


@dataclass(frozen=True)
class AudioInput:
    """One input: its id (unique), where it comes from (a path; bytes from a manifest; a member of
    the tar at ``path``, as (offset, size) of its data), ``columns`` carried to its row, and
    ``problem``: why it cannot be read, known when listed (its row's error)."""

    id: str
    path: str | None = None
    data: bytes | None = None
    member: tuple[int, int] | None = None
    columns: dict | None = field(default=None, compare=False, hash=False)
    problem: str | None = None


@dataclass
class Clip:
    """An input read for encoding: mono float32 samples at the model's rate, or the error."""

    input: AudioInput
    audio: np.ndarray | None
    duration: float | None
    sampling_rate: int | None
    error: str | None


def list_inputs(source: "str | Path | datasets.Dataset", suffixes: Sequence[str] | None = None,
                columns: Sequence[str] = ()) -> list[AudioInput]:
    """The inputs ``source`` names, sorted by id. A folder: every file under it (hidden ones and
    those not ending in one of ``suffixes`` excepted), id = its path relative to the folder. A
    .txt/.lst file: one path per line (ids: the paths). A .parquet/.jsonl manifest: a ``path`` or
    ``audio`` (bytes) column and an optional ``id`` column (default: the path, or the row number).
    A Hugging Face dataset: a ``datasets.Dataset``, a ``save_to_disk`` folder, or ``hf:NAME[@SPLIT]``
    (``load_dataset``): its ``audio`` column (bytes or paths, any rate), id = its ``id`` column or the
    row number. WebDataset shards: a .tar file or a glob of them (``data/shard-*.tar``): a sample per key
    (a member's path up to the first dot of its name), its audio member (.flac, .wav, .mp3, .opus,
    .ogg) read in place when its clip is read (never extracted), its .json member's fields the
    sample's columns; id = the key. ``columns``: the fields carried to each row (manifest columns,
    JSON fields)."""
    if _is_hf_dataset(source):
        return _unique("the dataset", _dataset_inputs(source, columns))
    if isinstance(source, str) and source.startswith(HF_PREFIX):
        return _unique(source, _dataset_inputs(_load_hf(source[len(HF_PREFIX):]), columns))
    if isinstance(source, str) and glob.has_magic(source):
        tars = sorted(glob.glob(source))
        if not tars or not all(t.endswith(TAR_SUFFIX) for t in tars):
            raise ValueError(f"{source}: a glob must name WebDataset .tar shards (it matched {len(tars)} paths, "
                             f"not all .tar)")
        return _unique(source, _tar_inputs(tars, columns))
    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist")
    if source.suffix.lower() == TAR_SUFFIX and source.is_file():
        return _unique(source, _tar_inputs([str(source)], columns))
    if source.is_dir() and (source / "state.json").is_file() and (source / "dataset_info.json").is_file():
        from datasets import load_from_disk  # a Hugging Face dataset saved with save_to_disk

        return _unique(source, _dataset_inputs(load_from_disk(str(source)), columns))
    if source.is_dir():
        keep = tuple(s.lower() for s in suffixes) if suffixes else None
        inputs = [AudioInput(id, path) for id, path in _files_under(str(source), "")
                  if keep is None or os.path.splitext(id)[1].lower() in keep]
    elif source.suffix.lower() in LIST_SUFFIXES:
        lines = [line.strip() for line in source.read_text().splitlines()]
        inputs = [AudioInput(line, line) for line in lines if line and not line.startswith("#")]
    elif source.suffix.lower() in MANIFEST_SUFFIXES:
        inputs = _manifest_inputs(source, columns)
    else:
        raise ValueError(f"{source}: expected a folder, a .txt/.lst list of paths, a .parquet/.jsonl manifest or "
                         "WebDataset .tar shards")
    return _unique(source, inputs)


def _is_hf_dataset(source) -> bool:
    return type(source).__name__ == "Dataset" and type(source).__module__.startswith("datasets")


def _load_hf(name: str):
    """``NAME`` or ``NAME@SPLIT`` (default train) through ``datasets.load_dataset``: a hub dataset,
    or a loader with its files (``parquet@train`` needs data_files: use the Python call)."""
    try:
        from datasets import load_dataset
    except ImportError:
        raise ImportError("hf: sources need Hugging Face datasets: pip install datasets") from None
    name, _, split = name.partition("@")
    return load_dataset(name, split=split or "train")


def _dataset_inputs(dataset, columns: Sequence[str], audio_column: str = AUDIO_COLUMN) -> list[AudioInput]:
    """A Hugging Face dataset's rows: its audio column read undecoded (bytes, or a path), the rows'
    ``columns`` carried, id = its ``id`` column or the row's number. The audio's bytes are held in
    memory, as a Parquet manifest's are."""
    from datasets import Audio

    if audio_column not in dataset.column_names:
        raise ValueError(f"the dataset has no {audio_column!r} column (it has {dataset.column_names[:12]})")
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise ValueError(f"the dataset has no column {missing[0]!r} to carry (it has {dataset.column_names[:12]})")
    keep = [audio_column, *columns, *(["id"] if "id" in dataset.column_names and "id" not in columns else [])]
    dataset = dataset.select_columns(keep)
    if isinstance(dataset.features[audio_column], Audio):
        dataset = dataset.cast_column(audio_column, Audio(decode=False))
    inputs = []
    for n, row in enumerate(dataset):
        audio = row[audio_column]
        data, path = (audio.get("bytes"), audio.get("path")) if isinstance(audio, dict) else \
            (audio, None) if isinstance(audio, bytes) else (None, audio)
        problem = None if data or path else f"its {audio_column!r} holds neither bytes nor a path"
        inputs.append(AudioInput(str(row.get("id", n)), None if data else path, data or None,
                                 columns={c: row.get(c) for c in columns}, problem=problem))
    return inputs


def _unique(source, inputs: list[AudioInput]) -> list[AudioInput]:
    repeated = [id for id, n in Counter(i.id for i in inputs).items() if n > 1]
    if repeated:
        raise ValueError(f"{source}: id {repeated[0]!r} appears more than once; ids must be unique")
    return sorted(inputs, key=lambda i: i.id)


def _tar_inputs(tars: Sequence[str], columns: Sequence[str]) -> list[AudioInput]:
    """Each WebDataset sample of ``tars``: its audio member's place in its tar and its JSON's
    columns; a sample without audio, or with JSON that does not parse, is an input with its problem.
    Only the members' headers and the JSON are read here."""
    import tarfile

    inputs = []
    for path in tars:
        try:
            tar = tarfile.open(path, "r:")  # uncompressed: a member's data is read in place by offset
        except (tarfile.TarError, OSError) as e:
            raise ValueError(f"{path}: not a readable uncompressed tar ({e})") from None
        with tar:
            samples: dict[str, dict[str, tarfile.TarInfo]] = {}
            for member in tar:
                if not member.isfile():
                    continue
                folder, _, name = member.name.rpartition("/")
                stem, dot, extension = name.partition(".")
                if dot:
                    samples.setdefault(f"{folder}/{stem}" if folder else stem, {})[extension.lower()] = member
            for key, members in samples.items():
                audio = next((members[e] for e in AUDIO_MEMBERS if e in members), None)
                fields, problem = {}, None
                if "json" in members:
                    try:
                        fields = json.loads(tar.extractfile(members["json"]).read())
                    except ValueError as e:
                        problem = f"its .json member does not parse: {e}"
                    fields = fields if isinstance(fields, dict) else {}
                if audio is None:
                    problem = f"no audio member ({', '.join('.' + e for e in AUDIO_MEMBERS)}) among {sorted(members)}"
                inputs.append(AudioInput(key, path, member=None if audio is None else (audio.offset_data, audio.size),
                                         columns={c: fields.get(c) for c in columns}, problem=problem))
    return inputs


def _files_under(folder: str, prefix: str) -> Iterator[tuple[str, str]]:
    """(id: the path relative to the walk's root, path) of every non-hidden file under ``folder``,
    hidden folders skipped (os.scandir: rglob and relative_to were slower; docs/measurements.md)."""
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.is_dir(follow_symlinks=False):  # as rglob: linked folders are not entered
                yield from _files_under(entry.path, prefix + entry.name + "/")
            elif entry.is_file():
                yield prefix + entry.name, entry.path


def _manifest_inputs(source: Path, columns: Sequence[str]) -> list[AudioInput]:
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
        inputs.append(AudioInput(str(row.get("id", path if data is None else n)), path if data is None else None, data,
                                 columns={c: row.get(c) for c in columns}))
    return inputs


def read_clip(item: AudioInput, rate: int) -> Clip:
    """Read one input as mono float32 at ``rate``; any failure becomes the clip's error."""
    try:
        if item.problem is not None:
            raise ValueError(item.problem)
        mono, source_rate = read_mono(io.BytesIO(_member(item)) if item.member is not None
                                      else item.path if item.data is None else io.BytesIO(item.data))
        duration = mono.numel() / source_rate
        mono = resample_mono(mono, source_rate, rate)
        return Clip(item, mono.numpy(), duration, source_rate, None)
    except Exception as error:  # noqa: BLE001 - recorded in the row: a corpus run goes on
        return Clip(item, None, None, None, f"{type(error).__name__}: {error}")


def _member(item: AudioInput) -> bytes:
    """A tar member's data, read in place."""
    offset, size = item.member
    with open(item.path, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    if len(data) != size:
        raise ValueError(f"{item.path} ends inside the member of {item.id}")
    return data
