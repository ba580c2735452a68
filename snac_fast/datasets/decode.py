"""decode_dataset: shards of codes back to audio files or Parquet shards of audio."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from snac_fast.datasets.runs import CodecSource, progress_bar
from snac_fast.datasets.shards import (
    read_shards,
    require_pyarrow,
    shard_name,
    write_atomically,
)


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
    require_pyarrow()
    rows = list(read_shards(source))
    names = {r.get("model") for r in rows if r.get("error") is None}
    if codec is None:
        if model is None and len(names) > 1:
            raise ValueError(f"{source} mixes models {sorted(names)}: pass model=")
        codec = CodecSource(model or next(iter(names), None), device, dtype, dict(model_options or {})).load()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    levels = codec.n_levels
    summary = {"rows": len(rows), "written": 0, "skipped": 0, "errors": 0}
    start = time.perf_counter()
    errors, table_rows = [], []
    names = _output_names([r.get("id") for r in rows if r.get("id") is not None], format)
    with progress_bar(len(rows), progress) as bar:
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
        write_atomically(table, out / shard_name(n))
