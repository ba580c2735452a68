"""What a shard's rows hold besides the codes: columns carried from the inputs (text, speaker, ...)
and, with ``format="orpheus"``, training-ready rows for Orpheus-family LMs.

``orpheus_ids``: each clip's codes as the LM's audio ids, 7 a frame (:data:`snac_fast.orpheus.ORPHEUS`:
id = 128266 + slot * 4096 + code). ``remove_duplicate_frames``: Unsloth's Orpheus notebook's step
(and canopylabs' data scripts'), which drops every frame whose first id equals the first id of the
last frame kept: the audio the ids decode to is then shorter than the clip (by the frames dropped),
so it is off by default. ``tokenizer``: ``input_ids`` = [start of human] + the tokenizer's ids of
the text (``"speaker: text"`` with a speaker column, as multi-speaker fine-tunes are prompted; its
own start of text first) + [end of text, end of human, start of AI, start of speech] + the audio
ids + [end of speech, end of AI]; ``labels`` = ``input_ids``; ``attention_mask`` all ones: the
notebook's ``create_input_ids``. The special ids: :mod:`snac_fast.orpheus`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from snac_fast.options import option
from snac_fast.orpheus import (
    END_OF_AI,
    END_OF_HUMAN,
    END_OF_SPEECH,
    END_OF_TEXT,
    START_OF_AI,
    START_OF_HUMAN,
    START_OF_SPEECH,
)

FORMATS = ("codes", "orpheus")


@dataclass(frozen=True)
class RowFormat:
    """A run's rows: ``columns`` carried from the inputs (as strings); ``format`` ``codes`` (the
    per-level codes alone) or ``orpheus`` (also ``orpheus_ids``); ``remove_duplicate_frames``;
    ``tokenizer`` (a transformers tokenizer name or folder: also ``input_ids``, ``labels``,
    ``attention_mask`` from ``text_column`` and, if set, ``speaker_column``)."""

    columns: tuple[str, ...] = option((), "comma-separated manifest columns or WebDataset JSON fields to carry to "
                                      "each row (as strings), e.g. text,speaker,language (default: none)",
                                      parse=lambda text: tuple(c for c in text.split(",") if c), shown="")
    format: str = option("codes", "orpheus: also orpheus_ids, each clip's codes as an Orpheus LM's audio ids (7 a "
                         "frame)", choices=FORMATS)
    remove_duplicate_frames: bool = option(False, "with --format orpheus: drop each frame whose first id repeats the "
                                           "last kept frame's (Unsloth's notebook; the audio gets shorter)")
    tokenizer: str | None = option(None, "with --format orpheus: a transformers tokenizer (hub name or folder) for "
                                   "input_ids / labels / attention_mask from --text-column")
    text_column: str = option("text", "the text of each clip")
    speaker_column: str | None = option(None, "prompt as 'speaker: text' from this column (multi-speaker fine-tunes)")

    def check(self, levels: int | None = None) -> "RowFormat":
        """ValueError naming the first problem (before any input is read; ``levels``: the model's,
        once known); returns the format."""
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {list(FORMATS)}, got {self.format!r}")
        if self.format != "orpheus" and (self.remove_duplicate_frames or self.tokenizer):
            raise ValueError("remove_duplicate_frames and tokenizer build Orpheus rows: add format='orpheus'")
        if self.format == "orpheus" and levels is not None and levels != 3:
            raise ValueError(f"Orpheus ids take a 3-level model (snac_24khz); this one has {levels} levels")
        return self

    @property
    def carried(self) -> tuple[str, ...]:
        """The columns taken from the inputs: ``columns``, and the tokenizer's text and speaker."""
        extra = (self.text_column, self.speaker_column) if self.tokenizer else ()
        return tuple(dict.fromkeys(c for c in (*self.columns, *extra) if c))

    def to_dict(self) -> dict:
        return {**asdict(self), "columns": list(self.columns)}

    @classmethod
    def from_dict(cls, values: dict) -> "RowFormat":
        return cls(**{**values, "columns": tuple(values.get("columns", ()))})


def carried_value(value: Any) -> str | None:
    """A carried column's value as its string (JSON for anything but a string)."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def remove_duplicate_frames(ids: Sequence[int], frame_size: int = 7) -> list[int]:
    """The notebook's rule: a frame is kept unless its first id equals the first id of the last
    frame kept (the first frame always is). ``ids``: whole frames."""
    if len(ids) % frame_size:
        raise ValueError(f"{len(ids)} ids are not whole frames of {frame_size}")
    kept = list(ids[:frame_size])
    for start in range(frame_size, len(ids), frame_size):
        if ids[start] != kept[-frame_size]:
            kept.extend(ids[start:start + frame_size])
    return kept


def training_ids(text_ids: Sequence[int], audio_ids: Sequence[int]) -> list[int]:
    """One training row's ids: the text's (the tokenizer's, its start of text included) framed by
    the Orpheus special tokens around the audio ids."""
    return [START_OF_HUMAN, *text_ids, END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH, *audio_ids,
            END_OF_SPEECH, END_OF_AI]


_tokenizers: dict[str, Any] = {}


def load_tokenizer(name: str):
    """transformers' AutoTokenizer for ``name`` (a hub name or a folder), once per process."""
    if name not in _tokenizers:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError("tokenizer= needs transformers: pip install transformers") from None
        _tokenizers[name] = AutoTokenizer.from_pretrained(name)
    return _tokenizers[name]


def extra_columns(row_format: RowFormat, clips, codes: Sequence[list[np.ndarray] | None], errors: list[str | None]):
    """The columns (name -> pyarrow array) a shard adds to its codes, one value per clip. A clip
    whose training row cannot be built (no text) gets its reason in ``errors`` (its codes stay)."""
    import pyarrow as pa
    import torch

    from snac_fast.orpheus import ORPHEUS

    columns = {}
    values = [dict(c.input.columns or {}) for c in clips]
    for name in row_format.carried:
        columns[name] = pa.array([carried_value(v.get(name)) for v in values], pa.string())
    if row_format.format != "orpheus":
        return columns
    ids = [None if c is None else ORPHEUS.codes_to_ids([torch.as_tensor(np.asarray(level)) for level in c]).tolist() for c in codes]
    if row_format.remove_duplicate_frames:
        ids = [None if i is None else remove_duplicate_frames(i, ORPHEUS.frame_size) for i in ids]
    columns["orpheus_ids"] = pa.array(ids, pa.list_(pa.int32()))
    if row_format.tokenizer:
        tokenizer = load_tokenizer(row_format.tokenizer)
        rows = []
        for k, (audio, value) in enumerate(zip(ids, values)):
            text = value.get(row_format.text_column)
            if audio is None:
                rows.append(None)
                continue
            if not isinstance(text, str) or not text.strip():
                rows.append(None)
                errors[k] = errors[k] or f"no text in column {row_format.text_column!r} to build input_ids from"
                continue
            speaker = value.get(row_format.speaker_column) if row_format.speaker_column else None
            prompt = f"{speaker}: {text}" if speaker else text
            rows.append(training_ids(tokenizer.encode(prompt, add_special_tokens=True), audio))
        columns["input_ids"] = columns["labels"] = pa.array(rows, pa.list_(pa.int32()))
        columns["attention_mask"] = pa.array([None if r is None else [1] * len(r) for r in rows], pa.list_(pa.int8()))
    return columns
