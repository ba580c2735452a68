"""What a run reads: inputs listed from a folder, a list or a manifest, and one clip read."""

from __future__ import annotations

import io
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from snac_fast.codes import read_mono, resample_mono

MANIFEST_SUFFIXES = (".parquet", ".jsonl")


LIST_SUFFIXES = (".txt", ".lst")


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
    hidden folders skipped (os.scandir: rglob and relative_to were slower; docs/measurements.md)."""
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
    try:
        mono, source_rate = read_mono(item.path if item.data is None else io.BytesIO(item.data))
        duration = mono.numel() / source_rate
        mono = resample_mono(mono, source_rate, rate)
        return Clip(item, mono.numpy(), duration, source_rate, None)
    except Exception as error:  # noqa: BLE001 - recorded in the row: a corpus run goes on
        return Clip(item, None, None, None, f"{type(error).__name__}: {error}")
