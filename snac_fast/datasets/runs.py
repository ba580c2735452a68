"""What every run shares: the codec it loads (:class:`CodecSource`), how its shards are written
(:class:`ShardWriting`), its model's name, its progress bar."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from snac_fast.configs import DEFAULT_MODEL
from snac_fast.datasets.rows import RowFormat
from snac_fast.options import option, part

ENGINES = ("local", "ray")


def _suffixes(text: str) -> tuple[str, ...] | None:
    """``--suffixes``' text: each suffix with its dot (``wav,.flac`` -> ``(".wav", ".flac")``)."""
    found = tuple(s if s.startswith(".") else "." + s for s in text.split(",") if s)
    return found or None


@dataclass(frozen=True)
class EncodeSettings:
    """What an ``encode-dataset`` run takes besides its source, output and model, each default
    written here once; the command's flags are made from these fields (:mod:`snac_fast.options`)."""

    files_per_shard: int = option(256, "inputs per Parquet shard")
    batch_seconds: float = option(300.0, "padded audio per encode batch")
    pad_seconds: float = option(1.0, "batch clips whose lengths round up to one multiple of this (0: only equal "
                                "padded lengths); codes are each clip's own encode's either way")
    suffixes: tuple[str, ...] | None = option(None, "comma-separated file suffixes to take from a folder (default: "
                                              "every file)", parse=_suffixes, shown="")
    loaders: int | None = option(None, "files read at a time, by reader processes of two threads (default: one per "
                                 "CPU up to 16; ray: per actor, at most its CPUs)")
    engine: str = option("local", "local: this process; ray: Ray Data, one actor per GPU, each the local engine over "
                         "a share of the shards (pip install 'snac-fast[ray]')", choices=ENGINES)
    address: str | None = option(None, "with --engine ray: join this Ray cluster (default: start a local one)")
    rows: RowFormat = part(RowFormat, "rows")

    def check(self) -> "EncodeSettings":
        """ValueError naming the first problem (the rows' agreement among themselves; the model's
        levels are checked once it is known); returns the settings."""
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be 'local' or 'ray', got {self.engine!r}")
        if self.files_per_shard < 1 or (self.loaders is not None and self.loaders < 1) or self.batch_seconds <= 0 \
                or self.pad_seconds < 0:
            raise ValueError("files_per_shard and loaders must be >= 1, batch_seconds > 0 and pad_seconds >= 0")
        self.rows.check()
        return self


@dataclass(frozen=True)
class CodecSource:
    """The codec a run loads, as its Ray actors are handed it: ``model`` (a name, default the
    default model, or a :class:`snac_fast.model.loading.Checkpoint` found already), ``device``, ``dtype``
    and ``options`` (``FastSNAC.from_pretrained``'s others: the hub options, ``fuse``, ...)."""

    model: Any = None
    device: str | None = None
    dtype: str | None = None
    options: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The model's name as given (a Checkpoint: its source)."""
        return str(getattr(self.model, "source", None) or self.model or DEFAULT_MODEL)

    def load(self):
        """The codec (:func:`snac_fast.api.load_codec`)."""
        from snac_fast.api import load_codec

        return load_codec(self.model, device=self.device, dtype=self.dtype, **self.options)

    def checkpoint(self):
        """The checkpoint :meth:`load` will load (its config, its source's name), found without
        building the model."""
        from snac_fast.api import HUB_OPTIONS
        from snac_fast.model.loading import Checkpoint, resolve_checkpoint

        if isinstance(self.model, Checkpoint):
            return self.model
        return resolve_checkpoint(self.model or DEFAULT_MODEL,
                                  **{k: v for k, v in self.options.items() if k in HUB_OPTIONS})

    def found(self) -> "CodecSource":
        """This source with its checkpoint looked up once: later loads make no second hub lookup."""
        return dataclasses.replace(self, model=self.checkpoint())


@dataclass(frozen=True)
class ShardWriting:
    """How a run's shards are batched and written: into ``out``, clips padded to multiples of
    ``pad_seconds`` in batches of ``batch_seconds`` of audio, rows as ``rows`` says."""

    out: str
    pad_seconds: float
    batch_seconds: float
    rows: RowFormat = RowFormat()


def model_name(codec) -> str:
    return codec.source or "in-memory model"


def progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="file", disable=not enabled or None, dynamic_ncols=True)
