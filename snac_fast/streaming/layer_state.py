"""State per layer: the stream step a CPU runs, computing each layer's new samples once.

The stage engine (:mod:`snac_fast.streaming.stage_forward`) keeps each stage's input context and
recomputes it every step: block 1 of the 24 kHz decoder computes 128 samples a frame where 32 are
new. That suits a GPU, where a step is launch-bound; on a CPU the recomputed work is the time. Here
every layer keeps only what its next outputs need, so a push of n new samples into a layer gives n
(times its upsampling) new outputs:

- a 'same' conv of k taps and dilation d keeps its last (k - 1) d inputs;
- a transposed conv (SNAC's kernel 2s, stride s) keeps its last input;
- a residual unit keeps the last 6d snake outputs its depthwise conv reads and the 3d inputs its
  skip path lags by;
- the local attention (32/44 kHz) keeps the inputs of its unfinished window;
- a NoiseBlock keeps nothing: its noise is keyed by absolute position, as in a whole decode.

Each layer so lags its input by a fixed delay (half its span, ceil(s/2) for a transposed conv, up
to a window for the attention), and a last delay line makes the whole lag the stage engine's exact
lookahead, so both emit the same audio at the same pushes. Shapes are the same for every row of a
batch whatever the rows' positions; the two ends are the only special cases:

- prefill (fresh rows): the states start at zero, the layers' left zero padding, and each layer's
  outputs before position 0 (its first ``delay`` outputs) are zeroed, so the next layer reads zeros;
- flush: zeros pushed in, and each layer's outputs past the signal's end (all but its first
  ``delay``) zeroed, so every layer sees its right zero padding.

Used by :class:`~snac_fast.streaming.StreamEngine` for exact streams on a CPU, and by
:meth:`snac_fast.FastSNAC.decode` there for decodes of 8 frames or more (docs/streaming.md, "On a CPU").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from snac_fast.model.layers import Kind, children_of, input_reach, kind_of
from snac_fast.model.noise import noise_blocks
from snac_fast.ops.conv_transpose import upsampling_padding
from snac_fast.ops.noise import keyed_normal_at
from snac_fast.streaming.geometry import Geometry, build_stages
from snac_fast.streaming.shapes import FLUSH, PREFILL, STEP

# a whole decode's steps take this many frames of all its rows together: whole activations of a long
# decode left the caches (60 s took 3.6x as long in one piece); 2 cores: 16 at B=1, 2-4 at B=8
DECODE_CHUNK_ROW_FRAMES = 16
EPS = 1e-9  # upstream's Snake1d: x + sin^2(alpha x) / (alpha + 1e-9)


@dataclass
class Run:
    """One call through the layers: the rows' keys (int64 [4, B]: state slot, frames consumed,
    seed, noise row, as the engine writes them) and every NoiseBlock's noise for it."""

    keys: Tensor
    noise: dict[int, Tensor]  # NoiseBlock index -> its noise [B, n, 1]


class _Layer:
    """A streaming layer. ``rate``: its output samples per latent sample; ``delay``: how many of
    its output samples lag the decode's position (output j of a push starting at latent position
    P is at ``P * rate - delay + j``). ``spans``: (samples, channels) of each state it keeps, time-major
    like the activations ([B, T, C])."""

    rate = 1
    delay = 0
    delay_own = 0  # what this layer adds to the delay of its input
    spans: tuple[tuple[int, int], ...] = ()
    masks = True  # outputs at positions outside the signal can be nonzero (a bias, a branch)

    def __call__(self, x: Tensor, states: list[Tensor], run: Run) -> tuple[Tensor, list[Tensor]]:
        raise NotImplementedError


def _snake(x: Tensor, alpha: Tensor, inverse: Tensor) -> Tensor:
    t = torch.sin(x * alpha)
    return torch.addcmul(x, t.square_(), inverse)


def _channels_first(x: Tensor) -> Tensor:
    """[B, T, C] -> the [B, C, 1, T] view whose memory is channels-last (oneDNN's fast depthwise)."""
    return x.permute(0, 2, 1).unsqueeze(2)


def _time_major(y: Tensor) -> Tensor:
    """A channels-last [B, C, 1, T] -> [B, T, C]."""
    return y.squeeze(2).permute(0, 2, 1)


class _Pointwise(_Layer):
    masks = False  # zero in, zero out

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, x, states, run):
        return self.fn(x), []


class _Snake(_Pointwise):
    def __init__(self, alpha: Tensor, dtype: torch.dtype) -> None:
        a = alpha.detach().reshape(-1).to(dtype)
        inverse = (a + EPS).reciprocal()
        super().__init__(lambda x: _snake(x, a, inverse))


class _Conv(_Layer):
    """A stride-1 'same' conv (zero padding (k - 1) d / 2 each side): a 1x1 conv as one GEMM, a
    wider one by oneDNN in channels-last memory."""

    def __init__(self, conv: nn.Conv1d, dtype: torch.dtype) -> None:
        k, d = conv.kernel_size[0], conv.dilation[0]
        weight = conv.weight.detach().to(dtype)
        self.bias = None if conv.bias is None else conv.bias.detach().to(dtype)
        self.dilation, self.groups, self.span = d, conv.groups, (k - 1) * d
        if k == 1 and conv.groups == 1:
            self.matrix = weight[:, :, 0].t().contiguous()  # [C_in, C_out]
        else:
            self.matrix, self.weight = None, weight.unsqueeze(2)
        self.spans = ((self.span, conv.in_channels),) if self.span else ()
        self.delay_own = self.span // 2
        self.masks = self.bias is not None

    def __call__(self, x, states, run):
        if self.matrix is not None:
            return (x @ self.matrix if self.bias is None else torch.addmm(self.bias, x.flatten(0, 1), self.matrix)
                    .view(x.shape[0], x.shape[1], -1)), []
        buffer = torch.cat([states[0], x], 1) if self.span else x
        y = F.conv2d(_channels_first(buffer), self.weight, self.bias, dilation=(1, self.dilation), groups=self.groups)
        return _time_major(y), [buffer[:, -self.span:]] if self.span else []


class _Transposed(_Layer):
    """SNAC's upsampling: kernel 2s, stride s, padding ceil(s/2), output padding s % 2. Its full
    output m takes inputs m // s and m // s - 1, so a push of n inputs after the last one kept gives
    n * s outputs: one GEMM of each pair of neighbouring inputs [x(i - 1) | x(i)] by an [s C_out, 2 C_in]
    weight, whose rows are the s phases' outputs in time order."""

    def __init__(self, conv: nn.ConvTranspose1d, dtype: torch.dtype) -> None:
        self.stride = s = conv.stride[0]
        if conv.kernel_size[0] != 2 * s or (conv.padding[0], conv.output_padding[0]) != upsampling_padding(s):
            raise ValueError(f"cannot stream through a transposed conv of kernel {conv.kernel_size[0]}, stride {s}")
        w = conv.weight.detach().to(dtype)  # [C_in, C_out, 2s]: output phase r takes x(i) by tap r, x(i - 1) by r + s
        # [s C_out, 2 C_in], as F.linear takes it: 25% faster than [2 C_in, s C_out] at block 1's 4 rows,
        # whose 33.5 MB weight streams from memory once a push (docs/streaming.md)
        self.weight = torch.cat([w[:, :, s:].permute(0, 2, 1).flatten(1), w[:, :, :s].permute(0, 2, 1).flatten(1)]).t().contiguous()
        self.bias = None if conv.bias is None else conv.bias.detach().to(dtype).repeat(s)
        self.channels = conv.out_channels
        self.spans = ((1, conv.in_channels),)
        self.delay_own = upsampling_padding(s)[0]

    def __call__(self, x, states, run):
        buffer = torch.cat([states[0], x], 1)
        B, n, _ = x.shape
        pairs = torch.cat([buffer[:, :-1], buffer[:, 1:]], 2).flatten(0, 1)  # [B n, 2 C_in]
        y = F.linear(pairs, self.weight, self.bias)
        return y.view(B, n * self.stride, self.channels), [buffer[:, -1:]]


class _Residual(_Layer):
    """x + pointwise(snake(depthwise(snake(x)))), the branch's conv of k taps at dilation d."""

    def __init__(self, unit: nn.Module, dtype: torch.dtype) -> None:
        snake1, conv, snake2, pointwise = unit.block
        self.snake1, self.snake2 = _Snake(snake1.alpha, dtype), _Snake(snake2.alpha, dtype)
        self.conv, self.pointwise = _Conv(conv, dtype), _Conv(pointwise, dtype)
        if self.pointwise.span or self.conv.span % 2:
            raise ValueError("cannot stream a residual unit whose last conv is not 1x1")
        self.lag = self.conv.span // 2
        channels = conv.in_channels
        self.spans = ((self.conv.span, channels), (self.lag, channels))
        self.delay_own = self.lag

    def __call__(self, x, states, run):
        h, (snakes,) = self.conv(self.snake1.fn(x), states[:1], run)
        y = self.pointwise(self.snake2.fn(h), [], run)[0]
        inputs = torch.cat([states[1], x], 1)
        n = x.shape[1]
        return y.add_(inputs[:, :n]), [snakes, inputs[:, n:]]


class _Noise(_Layer):
    """x + noise * linear(x), the noise keyed by (seed, row, block, absolute position)."""

    masks = False  # zero in, zero out

    def __init__(self, block: nn.Module, index: int, dtype: torch.dtype) -> None:
        self.matrix = block.linear.weight.detach().to(dtype)[:, :, 0].t().contiguous()
        self.index = index

    def __call__(self, x, states, run):
        return torch.addcmul(x, run.noise[self.index], x @ self.matrix), []


class _Attention(_Layer):
    """The local attention over whole windows of ``window`` samples aligned at position 0: keeps the
    inputs of the window not yet complete (a fixed count, since pushes are whole windows long)."""

    def __init__(self, module: nn.Module, window: int, channels: int) -> None:
        self.module, self.window, self.channels = module, window, channels

    def place(self, delay_in: int) -> None:
        self.held = -delay_in % self.window  # the buffer then starts at a window boundary
        self.spans = ((self.held, self.channels),) if self.held else ()
        self.delay_own = self.held

    def __call__(self, x, states, run):
        buffer = torch.cat([states[0], x], 1) if self.held else x
        n = x.shape[1]
        y = self.module(buffer[:, :n].transpose(1, 2)).transpose(1, 2)
        return y, [buffer[:, n:]] if self.held else []


class _Delay(_Layer):
    """A delay line of ``samples`` samples (one channel: the audio)."""

    masks = False

    def __init__(self, samples: int) -> None:
        self.spans = ((samples, 1),) if samples else ()
        self.delay_own = samples

    def __call__(self, x, states, run):
        if not self.spans:
            return x, []
        buffer = torch.cat([states[0], x], 1)
        n = x.shape[1]
        return buffer[:, :n], [buffer[:, n:]]


def _layers_of(model: nn.Module, dtype: torch.dtype) -> list[_Layer]:
    """The decoder of a SNAC (upstream's or after surgery: an absorbed layer is still its upstream
    self) as streaming layers, in order."""
    index_of = {id(m): i for i, m in enumerate(noise_blocks(model))}
    window = model.attn_window_size
    out: list[_Layer] = []

    def visit(module: nn.Module, channels: int) -> int:
        try:
            kind = kind_of(module)
        except ValueError:
            raise ValueError(f"cannot stream through {type(module).__name__}") from None
        if kind is Kind.BLOCK:
            for child in children_of(module):
                channels = visit(child, channels)
        elif kind is Kind.RESIDUAL:
            out.append(_Residual(module, dtype))
        elif kind is Kind.TRANSPOSED:
            out.append(_Transposed(module, dtype))
            channels = module.out_channels
        elif kind is Kind.CONV:
            input_reach(module, 0, streaming=True)  # a stride-1 'same'-padded conv, else ValueError
            out.append(_Conv(module, dtype))
            channels = module.out_channels
        elif kind is Kind.SNAKE:
            out.append(_Snake(module.alpha, dtype))
        elif kind is Kind.NOISE:
            out.append(_Noise(module, index_of[id(module)], dtype))
        elif kind is Kind.ATTENTION:
            out.append(_Attention(module, window, channels))
        elif kind is Kind.TANH:
            out.append(_Pointwise(torch.tanh))
        return channels

    channels = model.decoder.model[0].in_channels
    for module in model.decoder.model:
        channels = visit(module, channels)
    return out


class LayerStates:
    """A SNAC decoder streamed layer by layer for rows of state (one per stream slot, ``rows``
    of them). :meth:`forward` runs a prefill, step or flush on the latent of the rows named by
    ``keys`` and returns their new audio, exactly what the stage engine's step returns.

    ``lookahead``: the audio samples every output lags the newest frame by (the stage engine's exact
    lookahead, at least this decoder's own lag: a delay line makes up the difference).
    ``compile``: steps (not prefills and flushes) through torch.compile, whose C++ code fuses the
    elementwise work (snakes, joins, noise) between the GEMMs (docs/streaming.md, "On a CPU"): for
    a fixed batch; needs a C++ compiler, and the first step of each (rows, frames) shape compiles
    (~15-25 s on 2 cores; past torch's recompile limit, 8, new shapes run eagerly)."""

    @classmethod
    def whole_decoder(cls, model: nn.Module, config: dict, device: torch.device, dtype: torch.dtype) -> "LayerStates":
        """``model``'s decoder as layers with state for whole decodes (no state rows): a decode of 8
        frames or more runs through them as a stream would, 1.2x-4.2x the module tree's torch
        references on a CPU at 8 frames to 60 s (docs/streaming.md, "On a CPU")."""
        latent_per_frame = config["vq_strides"][0]
        lookahead = Geometry.of(build_stages(model, latent_per_frame), latent_per_frame,
                                config.get("attn_window_size")).lookahead_samples
        return cls(model, 0, lookahead, latent_per_frame, device=device, dtype=dtype)

    def __init__(self, model: nn.Module, rows: int, lookahead: int, latent_per_frame: int, *,
                 device: torch.device, dtype: torch.dtype, compile: bool = False) -> None:
        self.model, self.dtype, self.lookahead = model, dtype, lookahead
        self._build()
        self.channels = model.decoder.model[0].in_channels
        self.latent_per_frame = latent_per_frame
        self.hop = math.prod(model.decoder_rates)
        # a flush pushes whole attention windows of zeros, enough to carry the last lookahead samples out
        self.window = unit = model.attn_window_size or 1
        self.flush_latent = -(-lookahead // self.hop // unit) * unit
        with torch.inference_mode(False):
            self.states = [torch.zeros((rows, n, c), device=device, dtype=dtype)
                           for layer in self.layers for n, c in layer.spans]
        # one compile per (rows, frames) shape: a batch dimension marked dynamic recompiled on dynamo's
        # guards or broke inductor's channels-last convs (torch 2.11; docs/streaming.md)
        self._compiled_step = torch.compile(self._run, dynamic=False) if compile else None

    def _build(self) -> None:
        """The layers from the model's weights as they are now, with their delays."""
        self.layers = _layers_of(self.model, self.dtype)
        rate, delay = 1, 0
        for layer in self.layers:
            if isinstance(layer, _Attention):
                layer.place(delay)
            if isinstance(layer, _Transposed):
                rate, delay = rate * layer.stride, delay * layer.stride
            delay += layer.delay_own
            layer.rate, layer.delay = rate, delay
        if delay > self.lookahead:
            raise ValueError(f"this decoder lags its input by {delay} samples, more than the lookahead {self.lookahead}")
        tail = _Delay(self.lookahead - delay)
        tail.rate, tail.delay = rate, self.lookahead
        self.layers.append(tail)
        self._built_from = self._weights()

    def _weights(self) -> tuple:
        return tuple((p.data_ptr(), p._version) for p in self.model.decoder.parameters())

    def _current(self) -> None:
        """The layers hold copies of some weights (the transposed convs' phase layout): rebuilt when a
        weight of the model changed since (in place, or replaced), as the module tree would see it."""
        if self._weights() != self._built_from:
            self._build()
            if self._compiled_step is not None:
                self._compiled_step = torch.compile(self._run, dynamic=False)

    def forward(self, kind: str, keys: Tensor, latent: Tensor | None) -> Tensor:
        """keys: int64 [4, B] (slot, frames consumed, seed, noise row); latent: [B, C, n] (None for a
        flush) -> audio [B, 1, samples]: prefill ``n * hop - lookahead``, step ``n * hop``, flush
        ``lookahead`` samples."""
        self._current()
        slots = keys[0]
        states = self._fresh_states(slots.shape[0]) if kind == PREFILL else [s.index_select(0, slots) for s in self.states]
        if kind == FLUSH:
            return self._flush(states, keys)
        x = latent.transpose(1, 2).contiguous()
        if kind == PREFILL or self._compiled_step is None:
            audio, new_states = self._run(x, states, keys, kind)
        else:
            audio, new_states = self._compiled_step(x, states, keys, STEP)
        for state, new in zip(self.states, new_states):
            state.index_copy_(0, slots, new)
        return audio[:, :, self.lookahead:] if kind == PREFILL else audio

    def decode(self, keys: Tensor, latent: Tensor) -> Tensor:
        """A whole decode through the layers, on states of their own (the engine's rows untouched):
        the rows' latent [B, C, n] (n whole frames) as a prefill, steps of a few frames
        (:data:`DECODE_CHUNK_ROW_FRAMES`) and the flush. keys: int64 [4, B] (slot unused, frames
        consumed 0, seed, noise row) -> audio [B, 1, n * hop], what a stream of the same codes and
        seed gives."""
        self._current()
        B, _, n = latent.shape
        x = latent.transpose(1, 2)
        states = self._fresh_states(B)
        chunk_frames = max(1, DECODE_CHUNK_ROW_FRAMES // B)
        step = -(-chunk_frames * self.latent_per_frame // self.window) * self.window
        # the prefill must carry every layer past position 0 (its outputs before it are zeroed): as
        # many whole windows as a flush pushes
        first = max(step, self.flush_latent)
        keys = keys.clone()
        pieces, start = [], 0
        while start < n:
            stop = min(n, start + (step if start else first))
            keys[1] = start // self.latent_per_frame
            audio, states = self._run(x[:, start:stop].contiguous(), states, keys, STEP if start else PREFILL)
            pieces.append(audio if start else audio[:, :, self.lookahead:])
            start = stop
        keys[1] = n // self.latent_per_frame
        samples = n * self.hop  # shorter than the lookahead: the flush holds all of it
        pieces.append(self._flush(states, keys)[:, :, max(0, self.lookahead - samples):])
        return torch.cat(pieces, 2)

    def _fresh_states(self, rows: int) -> list[Tensor]:
        """Zero states for ``rows`` streams at their start (the layers' left zero padding)."""
        return [torch.zeros((rows,) + s.shape[1:], dtype=s.dtype, device=s.device) for s in self.states]

    def _flush(self, states: list[Tensor], keys: Tensor) -> Tensor:
        """The rows' ends (keys[1]: their frames): zeros pushed until their last ``lookahead`` samples
        are out -> audio [B, 1, lookahead]."""
        x = torch.zeros((keys.shape[1], self.flush_latent, self.channels), dtype=self.dtype, device=keys.device)
        return self._run(x, states, keys, FLUSH)[0][:, :, :self.lookahead]

    def _run(self, x: Tensor, states: list[Tensor], keys: Tensor, kind: str) -> tuple[Tensor, list[Tensor]]:
        """The layers on x [B, n, C] from ``states`` (gathered for the rows): (audio [B, 1, samples],
        the states after). A pure function of its tensors: what ``compile`` hands torch.compile."""
        run = Run(keys, self._noise(keys, x.shape[1], x.dtype))
        new_states: list[Tensor] = []
        at = 0
        for layer in self.layers:
            count = len(layer.spans)
            x, kept = layer(x, states[at:at + count], run)
            at += count
            # copies: a kept span is a view of the layer's whole input buffer, which it would hold
            # to the call's end (two thirds of a CPU call's live memory: 10.5 -> 3.6 MB a stream-frame)
            new_states += [k.clone() for k in kept]
            if layer.masks and kind in (PREFILL, FLUSH) and layer.delay:
                if kind == PREFILL:
                    x[:, :layer.delay] = 0  # before position 0: the next layer's left zero padding
                else:
                    x[:, layer.delay:] = 0  # past the signal's end: its right zero padding
        return x.transpose(1, 2), new_states

    def _noise(self, keys: Tensor, latent: int, dtype: torch.dtype) -> dict[int, Tensor]:
        """Every NoiseBlock's noise for a call of ``latent`` samples, drawn in one pass:
        {block index: [B, n, 1]}, sample j of a block's input at position ``F * rate * latent_per_frame
        - delay + j`` (F: the row's frames consumed before the call)."""
        blocks = [layer for layer in self.layers if isinstance(layer, _Noise)]
        if not blocks:
            return {}
        device = keys.device
        positions = torch.cat([keys[1][:, None] * (layer.rate * self.latent_per_frame) - layer.delay
                               + torch.arange(latent * layer.rate, device=device) for layer in blocks], 1)
        index = torch.cat([torch.full((latent * layer.rate,), layer.index, dtype=torch.int64, device=device)
                           for layer in blocks])
        noise = keyed_normal_at(keys[2], keys[3], positions, index).to(dtype).unsqueeze(2)
        return dict(zip((layer.index for layer in blocks), noise.split([latent * l.rate for l in blocks], 1)))
