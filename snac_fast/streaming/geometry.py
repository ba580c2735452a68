"""Stream geometry: the decoder cut into stages, each stage's left and right context, and where
every stage's samples sit after F frames (see :mod:`snac_fast.streaming`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

from torch import nn

from snac_fast.model.layers import Kind, input_reach, kind_of
from snac_fast.model.noise import noise_blocks


def _upsample(layers: Iterable[nn.Module]) -> int:
    return math.prod(m.stride[0] for layer in layers for m in layer.modules() if isinstance(m, nn.ConvTranspose1d))


@dataclass
class Stage:
    """Decoder layers run as one streaming unit. ``layers`` run on the buffer [context | new], then
    the valid outputs are cropped and ``post`` (the local attention) runs on them. Positions are in
    the stage's input samples; ``upsample`` output samples follow each input sample."""

    layers: list[nn.Module]
    post: list[nn.Module]
    channels: int
    left: int
    right: int
    upsample: int
    noise: list[tuple[int, int]] = field(default_factory=list)  # (NoiseBlock index, its samples per input sample)

    @property
    def context(self) -> int:
        return self.left + self.right


def build_stages(model: nn.Module, latent_per_frame: int) -> list[Stage]:
    """Cut a SNAC decoder (upstream's or after surgery) into stages; see the module docstring."""
    layers = list(model.decoder.model)
    blocks = [i for i, m in enumerate(layers) if kind_of(m) is Kind.BLOCK]
    if not blocks:
        raise ValueError("cannot stream a decoder without DecoderBlocks")
    groups = [layers[:blocks[0]]] + [[layers[i]] for i in blocks]
    groups[-1] += layers[blocks[-1] + 1:]
    index_of = {id(m): i for i, m in enumerate(noise_blocks(model))}
    window = model.attn_window_size
    stages = []
    for group in groups:
        post = [m for m in group if kind_of(m) is Kind.ATTENTION]
        if post and group[-1] is not post[-1]:
            raise ValueError("cannot stream: layers after the local attention in its stage")
        convs = [m for m in group if kind_of(m) is not Kind.ATTENTION]
        reach = 0
        for layer in reversed(convs):
            reach = input_reach(layer, reach, streaming=True)
        right = -(-reach // window) * window if post else reach  # the attention takes whole windows
        channels = next(m for m in convs[0].modules() if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d))).in_channels
        stage = Stage(convs, post, channels, reach, right, _upsample(convs))
        scale = 1
        for m in (m for layer in convs for m in layer.modules()):
            if isinstance(m, nn.ConvTranspose1d):
                scale *= m.stride[0]
            elif id(m) in index_of:
                stage.noise.append((index_of[id(m)], scale))
        stages.append(stage)
    return stages


@dataclass
class Geometry:
    """Where every stage's samples sit. With F frames consumed, stage l's next new input sample is
    at ``a[l] * F + b[l]`` (input units); the audio made so far ends at ``a[-1] * F + b[-1]``."""

    stages: list[Stage]
    latent_per_frame: int
    group: int  # frames per step unit (attention windows)
    a: list[int]
    b: list[int]
    prefill_frames: int

    @classmethod
    def of(cls, stages: list[Stage], latent_per_frame: int, window: int | None) -> "Geometry":
        group = 1 if not window else window // math.gcd(window, latent_per_frame)
        a, b = [latent_per_frame], [0]
        for s in stages:
            a.append(a[-1] * s.upsample)
            b.append((b[-1] - s.right) * s.upsample)
        prefill = group
        while not all(a[l] * prefill + b[l] >= s.context and a[l] * prefill + b[l] > s.right
                      for l, s in enumerate(stages)):
            prefill += group
        return cls(stages, latent_per_frame, group, a, b, prefill)

    @property
    def lookahead_samples(self) -> int:
        """Audio samples that wait for later frames: the decode's receptive field to the right."""
        return -self.b[-1]


# Triton specializes a stride divisible by 16 and only then vectorizes loads along time: steps whose
# buffers were not ran their block 3-4 kernels 1.5-3x slower (docs/measurements.md)
ALIGN = 16


def align_contexts(stages: list[Stage], geometry: "Geometry") -> None:
    """Widen each stage's left context so that in a one-group step the outputs of its upsampling
    (``[context | new]`` times ``upsample``; its input is read channels-last) are a multiple of
    :data:`ALIGN` samples long. Extra left context changes no output: the cropped outputs'
    receptive fields still lie inside the buffer."""
    for stage, a in zip(stages, geometry.a):
        unit = ALIGN // math.gcd(ALIGN, stage.upsample)
        stage.left += -(stage.context + a * geometry.group) % unit


