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

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from snac_fast.compiling import compiling_concurrently
from snac_fast.graphs import GraphCache
from snac_fast.ops._runtime import device_scope


def _conv_reach(conv: nn.Conv1d, reach: int) -> int:
    """Input samples a conv needs on each side when its outputs need ``reach`` on each side:
    output j reads inputs j * stride - padding + [0, dilation * (kernel - 1)]."""
    k, d, p, s = conv.kernel_size[0], conv.dilation[0], conv.padding[0], conv.stride[0]
    return reach * s + max(p, d * (k - 1) - p)


def encoder_reach(model: nn.Module) -> int:
    """Audio samples on each side of a latent step's span that its value depends on (the encoder's
    receptive field; the 32/44 kHz attention windows counted whole). 24 kHz: 5,268 samples."""
    from snac.attention import LocalMHA

    def reach_of(module: nn.Module, reach: int) -> int:
        if isinstance(module, LocalMHA):  # a window's outputs read the whole window
            return math.ceil(reach / module.window_size) * module.window_size
        if isinstance(module, nn.Conv1d):
            return reach if getattr(module, "absorbed_by", "") else _conv_reach(module, reach)
        children = list(module.children())
        for child in reversed(children):  # Sequential, blocks, residual units: their layers in reverse
            reach = reach_of(child, reach)
        return reach

    return reach_of(model.encoder, 0)


def padding_unit(config: dict) -> int:
    """Upstream's ``preprocess`` pads audio to a multiple of this many samples: hop length x
    lcm(coarsest quantizer stride, attention window). config: the model's config.json entries."""
    hop = math.prod(config["encoder_rates"])
    return hop * math.lcm(config["vq_strides"][0], config.get("attn_window_size") or 1)


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


class GraphedEncode(GraphCache):
    """Replays ``model.encode`` from CUDA graphs keyed by the audio's shape (a bounded LRU cache).

    Input: audio [B, 1, T] in the model's dtype on its device, T a multiple of the padding unit.
    Output: int64 codes [B, L_i] per level, fresh tensors (the graph's buffers are copied).
    """

    def __init__(self, model: nn.Module, device: torch.device, max_graphs: int = 8, warmup: int = 2) -> None:
        super().__init__(max_graphs)
        self.model = model
        self.device = torch.device(device)
        self.warmup = warmup

    def __call__(self, audio: Tensor) -> list[Tensor]:
        static_audio, codes, graph = self._captured((tuple(audio.shape), audio.dtype), lambda: self._capture(audio),
                                                     f"audio of shape {tuple(audio.shape)}")
        static_audio.copy_(audio)
        graph.replay()
        return [c.clone() for c in codes]

    def _capture(self, audio: Tensor) -> tuple[Tensor, list[Tensor], torch.cuda.CUDAGraph]:
        with device_scope(self.device):  # side streams and the graph on the model's device, whichever is current
            return self._capture_here(audio)

    def _capture_here(self, audio: Tensor) -> tuple[Tensor, list[Tensor], torch.cuda.CUDAGraph]:
        with torch.inference_mode(False):
            static_audio = audio.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(stream):
            with compiling_concurrently():  # shapes only: every kernel variant compiles at once
                self.model.encode(static_audio)
            for _ in range(self.warmup):
                self.model.encode(static_audio)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, stream=torch.cuda.Stream(self.device)):
            codes = self.model.encode(static_audio)
        torch.cuda.current_stream().synchronize()
        return static_audio, codes, graph


def encode_padded(model: nn.Module, audio: Tensor, unit: int, chunk_samples: int | None, reach: int,
                  graphs: GraphedEncode | None = None) -> list[Tensor]:
    """Codes of audio [B, 1, T] (model dtype and device, T a multiple of the padding ``unit``),
    ``chunk_samples`` at a time (None: whole) with halos of ``reach`` (:func:`encoder_reach`), each
    chunk through ``graphs`` when given."""
    run = graphs if graphs is not None else model.encode
    length = audio.shape[-1]
    chunks = plan_chunks(length, chunk_samples or length, reach, unit)
    if len(chunks) == 1:
        return run(audio)
    per_code = [model.hop_length * q.stride for q in model.quantizer.quantizers]  # audio samples per code
    parts: list[list[Tensor]] = [[] for _ in per_code]
    for c in chunks:
        codes = run(audio[..., c.read_start:c.read_end])
        for level, (code, samples) in enumerate(zip(codes, per_code)):
            first = (c.keep_start - c.read_start) // samples
            parts[level].append(code[:, first:first + (c.keep_end - c.keep_start) // samples])
    return [torch.cat(p, dim=1) for p in parts]
