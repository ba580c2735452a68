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
- Audio is read (soundfile), mixed down to mono and resampled to the model's rate, ``loaders``
  files at a time (default: one per CPU, up to 16), by worker processes of two reading threads each
  at the lowest CPU priority, two shards ahead of the GPU. Not threads of this process: reading
  threads keep its GIL busy, and the thread that launches the encoder's kernels then waits for it
  at every launch (an encode ran 15-27x slower beside 16 reading threads).
  A reader process that dies (a crash in the audio library) costs only the file it was reading:
  that shard is read again one file at a time, and the culprit gets an error row.
- Clips are batched by length: clips whose lengths round up to one multiple of ``pad_seconds``
  (rounded to the model's padding unit) are zero-padded to it and encoded together, up to
  ``batch_seconds`` of audio per batch, each row as if alone (``codec.encode``'s ``lengths``), and
  each clip's codes are cut to its own length. A clip's codes are therefore ``codec.encode`` of the
  clip alone whatever ``pad_seconds`` and its batch mates (identical in float32).

``decode_dataset(source, out)`` turns such shards back into audio files (WAV or FLAC, one per row,
named by id) or Parquet shards with an ``audio`` column, skipping rows with an error (listed in
``out/_errors.jsonl``) and files already written.

Inputs can also be a Hugging Face dataset or WebDataset tar shards, and rows can carry the inputs'
columns and Orpheus training rows (``rows``: :class:`RowFormat`; docs/datasets.md).

Modules: ``inputs`` (what a run reads), ``readers`` (reader processes), ``rows`` (what rows hold
beside the codes), ``batching`` (clips to batches and codes back), ``shards`` (Parquet shards and
the run's record), ``encode`` and ``decode`` (the two runs), ``local_engine`` (one codec's shard
loop), ``ray_engine`` (the same loop in Ray Data actors), ``runs`` (what both share: the options,
:class:`EncodeSettings`, whose fields make ``encode-dataset``'s flags; the codec a run loads; how
its shards are written).
"""

from snac_fast.datasets.batching import (
    BatchQueues,
    batch_audio,
    code_lengths,
    finish_clips,
    launch_batches,
    launch_clips,
    length_batches,
    padded_length,
)
from snac_fast.datasets.decode import decode_dataset
from snac_fast.datasets.encode import encode_back_to_back, encode_dataset
from snac_fast.datasets.inputs import AudioInput, Clip, list_inputs, read_clip
from snac_fast.datasets.local_engine import write_shard
from snac_fast.datasets.rows import RowFormat
from snac_fast.datasets.runs import EncodeSettings
from snac_fast.datasets.shards import read_shards, shard_name, shard_table

__all__ = [
    "AudioInput",
    "Clip",
    "list_inputs",
    "read_clip",
    "padded_length",
    "code_lengths",
    "length_batches",
    "batch_audio",
    "BatchQueues",
    "launch_batches",
    "launch_clips",
    "finish_clips",
    "shard_table",
    "shard_name",
    "read_shards",
    "encode_dataset",
    "write_shard",
    "encode_back_to_back",
    "decode_dataset",
    "RowFormat",
    "EncodeSettings",
]
