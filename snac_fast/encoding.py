"""Encoding: CUDA graphs per audio shape, and long audio in chunks with halos.

A fused encode is ~45 kernels plus the quantizer's small float32 operations; for a 10 s clip
launching them costs as much as running them, so on CUDA each audio shape is captured once and
replayed (:class:`GraphedEncode`).

Long audio is encoded in chunks so that memory stays bounded (activations of the first block are
``encoder_dim`` channels at the full sampling rate: 48 x 2 bytes a sample at 24 kHz, 8 GB for an
hour). Each chunk is read with a halo on both sides of at least the encoder's receptive field
(:func:`encoder_reach`), rounded up to upstream's padding unit (hop length x the coarsest
quantizer stride x the attention window) so that pooling groups and attention windows fall where
they fall in a whole-file encode, and only the codes of the chunk's own span are kept. Every kept
code is therefore computed from the same audio samples, through the same layers, as in a
whole-file encode: in float32 and float64 the codes are identical (tested); in half precision a
kernel may pick a different tile or summation order for a different length, so a code whose two
nearest codewords are within rounding of each other may flip, as between any two float16 runs of
different shapes.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor, nn

from snac_fast.model.layers import input_reach, is_absorbed
from snac_fast.ops.device import device_scope
from snac_fast.ops.row_tails import clear_row_tails
from snac_fast.runtime.compiling import compiling_concurrently
from snac_fast.runtime.graphs import GraphCache


def encoder_reach(model: nn.Module) -> int:
    """Audio samples on each side of a latent step's span that its value depends on (the encoder's
    receptive field, :func:`snac_fast.model.layers.input_reach`; the 32/44 kHz attention windows counted
    whole). 24 kHz: 5,268 samples."""
    return input_reach(model.encoder.block, 0)


def padding_unit(config: dict) -> int:
    """Upstream's ``preprocess`` pads audio to a multiple of this many samples: hop length x
    lcm(coarsest quantizer stride, attention window). config: the model's config.json entries."""
    hop = math.prod(config["encoder_rates"])
    return hop * math.lcm(config["vq_strides"][0], config.get("attn_window_size") or 1)


def _tail_width(encoder: nn.Module) -> int:
    """Steps past a row's end that any encoder conv reads when computing the row's own outputs:
    the last output j = end / s - 1 reads up to end - s - p + d (k - 1)."""
    width = 0
    for conv in encoder.modules():
        if isinstance(conv, nn.Conv1d) and not is_absorbed(conv):
            k, d, p, s = conv.kernel_size[0], conv.dilation[0], conv.padding[0], conv.stride[0]
            width = max(width, d * (k - 1) - p - s + 1)
    return width


def _layers_read_by_wider_convs(encoder: nn.Module) -> list[nn.Module]:
    """The encoder's layers whose outputs later layers read across steps: every top-level layer but
    the last (the quantizer pools whole groups) and every layer of an encoder block but its last
    (that output is the block's). Absorbed layers pass their input on: skipped."""
    from snac.layers import EncoderBlock

    layers = []
    for layer in list(encoder.block)[:-1]:
        if isinstance(layer, EncoderBlock):
            layers += list(layer.block)[:-1]
        layers.append(layer)
    return [layer for layer in layers if not is_absorbed(layer)]


@contextmanager
def rows_as_alone(model: nn.Module, lengths: Tensor, total: int) -> Iterator[None]:
    """While active, ``model.encoder`` encodes each row of a zero-padded batch as upstream encodes
    that row alone: after each layer whose output a wider conv reads, the row's activations on the
    steps past its own end that such a conv reaches are set to zero (see the module docstring).

    lengths: int64 [B] on the model's device, each row's length in samples, a multiple of the
    padding unit (upstream's padded length of the clip), at most ``total``, the batch's length.
    Device operations only (no host sync): capturable in a CUDA graph."""
    width = _tail_width(model.encoder)

    def clear_tails(module: nn.Module, inputs, output) -> None:
        for t in output if isinstance(output, tuple) else (output,):
            clear_row_tails(t, lengths, total, width)

    handles = [layer.register_forward_hook(clear_tails) for layer in _layers_read_by_wider_convs(model.encoder)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class Chunk:
    """Read audio [read_start, read_end), keep the codes of [keep_start, keep_end) (samples)."""

    read_start: int
    read_end: int
    keep_start: int
    keep_end: int


def plan_chunks(length: int, chunk: int, halo: int, unit: int) -> list[Chunk]:
    """Chunks covering ``length`` padded samples: spans of ``chunk`` samples (rounded up to
    ``unit``), each read with ``halo`` samples (rounded up to ``unit``) on both sides where the audio
    has them. One chunk when the whole input is not longer than a chunk and its two halos."""
    if length % unit:
        raise ValueError(f"length {length} is not a multiple of the padding unit {unit}")
    chunk = max(unit, math.ceil(chunk / unit) * unit)
    halo = math.ceil(halo / unit) * unit
    if length <= chunk + 2 * halo:
        return [Chunk(0, length, 0, length)]
    return [Chunk(max(0, start - halo), min(length, start + chunk + halo), start, min(length, start + chunk))
            for start in range(0, length, chunk)]


def encode_rows(model: nn.Module, audio: Tensor, lengths: Tensor | None = None) -> list[Tensor]:
    """``model.encode(audio)``; with ``lengths`` (see :func:`rows_as_alone`), each row as if alone."""
    if lengths is None:
        return model.encode(audio)
    with rows_as_alone(model, lengths, audio.shape[-1]):
        return model.encode(audio)


_NO_GRAPH = object()  # a shape whose capture ran out of memory (capture_at > 1): it runs eagerly


class GraphedEncode(GraphCache):
    """Replays :func:`encode_rows` from CUDA graphs keyed by the audio's shape and whether rows have
    lengths (a bounded LRU cache).

    Input: audio [B, 1, T] in the model's dtype on its device, T a multiple of the padding unit;
    lengths: None or int64 [B] on the device (:func:`rows_as_alone`).
    Output: int64 codes [B, L_i] per level, fresh tensors (the graph's buffers are copied).

    capture_at: a shape is captured on its ``capture_at``-th call, the calls before run eagerly
    (1: at once, after ``warmup`` eager runs; 2: a shape that never comes back is never captured, and
    the eager call before the capture stands in for the warm-up runs). shared_pool: every graph
    allocates from one memory pool (the largest graph's activations instead of each graph's own);
    safe because replays run one at a time in stream order and outputs are copied before the next.
    With ``capture_at`` > 1 a capture that runs out of GPU memory, even after the allocator's cache
    is freed, leaves its shape eager instead of failing the call.
    """

    def __init__(self, model: nn.Module, device: torch.device, max_graphs: int = 8, warmup: int = 2,
                 capture_at: int = 1, shared_pool: bool = False) -> None:
        super().__init__(max_graphs)
        if capture_at < 1:
            raise ValueError("capture_at must be at least 1")
        self.model = model
        self.device = torch.device(device)
        self.warmup = warmup
        self.capture_at = capture_at
        self._calls: OrderedDict[tuple, int] = OrderedDict()  # eager calls per shape not captured yet (bounded)
        self._pool = torch.cuda.graph_pool_handle() if shared_pool else None
        # one capture stream for all: the allocator reuses a freed block only on the stream it was
        # made on, so a new stream per capture would grow the shared pool by a graph's worth each time
        self._capture_stream = torch.cuda.Stream(self.device) if shared_pool else None

    def __call__(self, audio: Tensor, lengths: Tensor | None = None) -> list[Tensor]:
        key = (tuple(audio.shape), audio.dtype, lengths is not None)
        if key not in self and self._eager_call(key):
            return encode_rows(self.model, audio, lengths)
        captured = self._captured(key, lambda: self._capture(audio, lengths), f"audio of shape {tuple(audio.shape)}")
        if captured is _NO_GRAPH:
            return encode_rows(self.model, audio, lengths)
        static_audio, static_lengths, codes, graph = captured
        static_audio.copy_(audio)
        if lengths is not None:
            static_lengths.copy_(lengths)
        graph.replay()
        return [c.clone() for c in codes]

    def _eager_call(self, key: tuple) -> bool:
        """Whether this call of a shape not captured runs eagerly (see ``capture_at``)."""
        calls = self._calls.pop(key, 0) + 1
        if calls >= self.capture_at:
            return False
        self._calls[key] = calls
        while len(self._calls) > 64 * self.max_graphs:  # a stream of one-off shapes
            self._calls.popitem(last=False)
        return True

    def _capture(self, audio: Tensor, lengths: Tensor | None):
        with device_scope(self.device):  # side streams and the graph on the model's device, whichever is current
            return self._capture_here(audio, lengths)

    def _capture_here(self, audio: Tensor, lengths: Tensor | None):
        with torch.inference_mode(False):
            static_audio = audio.clone()
            static_lengths = None if lengths is None else lengths.clone()
        if self.capture_at == 1:  # else this shape ran eagerly already: kernels compiled, lazy state made
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.inference_mode(), torch.cuda.stream(stream):
                with compiling_concurrently():  # shapes only: every kernel variant compiles at once
                    encode_rows(self.model, static_audio, static_lengths)
                for _ in range(self.warmup):
                    encode_rows(self.model, static_audio, static_lengths)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, stream=self._stream_for_capture()):
                codes = encode_rows(self.model, static_audio, static_lengths)
            torch.cuda.current_stream().synchronize()
            return static_audio, static_lengths, codes, graph
        for _ in range(2):  # the second time after freeing the cache; failing that, the shape stays eager
            try:
                graph, codes = self._capture_queued(static_audio, static_lengths)
                return static_audio, static_lengths, codes, graph
            except torch.OutOfMemoryError:
                # a capture cannot free the allocator's cached blocks (eager encodes' of other shapes)
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
        return _NO_GRAPH

    def _stream_for_capture(self) -> torch.cuda.Stream:
        return self._capture_stream or torch.cuda.Stream(self.device)

    def _capture_queued(self, static_audio: Tensor, static_lengths: Tensor | None):
        """A capture without torch.cuda.graph's device sync and cache flushes (pinned host memory
        included): a corpus encode captures while earlier batches run and other threads copy codes."""
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.stream(self._stream_for_capture()):
            graph.capture_begin(*([] if self._pool is None else [self._pool]), capture_error_mode="thread_local")
            try:
                codes = encode_rows(self.model, static_audio, static_lengths)
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the capture is invalid already
                    graph.capture_end()
                raise
            graph.capture_end()
        return graph, codes


def encode_padded(model: nn.Module, audio: Tensor, unit: int, chunk_samples: int | None, reach: int,
                  graphs: GraphedEncode | None = None, lengths: Tensor | None = None) -> list[Tensor]:
    """Codes of audio [B, 1, T] (model dtype and device, T a multiple of the padding ``unit``),
    ``chunk_samples`` at a time (None: whole) with halos of ``reach`` (:func:`encoder_reach`), each
    chunk through ``graphs`` when given; with ``lengths`` (int64 [B], multiples of ``unit``), each
    row as if alone (:func:`rows_as_alone`)."""
    def run(piece: Tensor, piece_lengths: Tensor | None) -> list[Tensor]:
        if graphs is not None:
            return graphs(piece, piece_lengths)
        return encode_rows(model, piece, piece_lengths)

    length = audio.shape[-1]
    chunks = plan_chunks(length, chunk_samples or length, reach, unit)
    if len(chunks) == 1:
        return run(audio, lengths)
    per_code = [model.hop_length * q.stride for q in model.quantizer.quantizers]  # audio samples per code
    parts: list[list[Tensor]] = [[] for _ in per_code]
    for c in chunks:
        # a row that ends inside the chunk ends there as it does alone; one that ended before it is not kept
        piece_lengths = None if lengths is None else (lengths - c.read_start).clamp(0, c.read_end - c.read_start)
        codes = run(audio[..., c.read_start:c.read_end], piece_lengths)
        for level, (code, samples) in enumerate(zip(codes, per_code)):
            first = (c.keep_start - c.read_start) // samples
            parts[level].append(code[:, first:first + (c.keep_end - c.keep_start) // samples])
    return [torch.cat(p, dim=1) for p in parts]
