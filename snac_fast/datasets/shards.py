"""Parquet shards of codes: building, writing atomically, the run's record, reading back."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from snac_fast.datasets.inputs import Clip
from snac_fast.datasets.rows import RowFormat, extra_columns


def shard_table(clips: Sequence[Clip], codes: Sequence[list[np.ndarray] | None], model: str, levels: int,
                row_format: RowFormat | None = None):
    """A pyarrow Table of one shard: a row per clip, in order; ``row_format``'s columns after the
    codes (:mod:`snac_fast.datasets.rows`)."""
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
    errors = [c.error for c in clips]
    if row_format is not None:
        columns.update(extra_columns(row_format, clips, codes, errors))
    columns["error"] = pa.array(errors, pa.string())
    return pa.table(columns)


def write_atomically(table, path: Path) -> None:
    import pyarrow.parquet as pq

    partial = path.with_name(path.name + ".partial")
    pq.write_table(table, partial)
    os.replace(partial, path)  # a crash leaves no half shard that a resumed run would trust


def check_run(out: Path, settings: dict) -> None:
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


def require_pyarrow() -> None:
    """ImportError naming the extra, at the start of a dataset job rather than at its first shard."""
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ImportError("datasets need pyarrow: pip install 'snac-fast[datasets]'") from None


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
