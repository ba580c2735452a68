"""Stage one of state per layer for the stream step (#45; CPU, float64, no kernels): a 24 kHz
decoder streamed layer by layer, each layer keeping only the inputs its next outputs need (a conv
its last (k - 1) * dilation inputs, a transposed conv its last input frame, a residual unit's skip
path the inputs its conv branch lags by), so that a push computes each layer's new outputs once.
The engine today keeps state per stage (a DecoderBlock) and recomputes each stage's context at
every step (docs/kernels.md, "The 64-stream step": block 1 computes 128 samples a stream for 32 new).

Checks, on a SNAC decoder with seeded random weights: (1) these layers given the whole signal at
once equal upstream's ``Decoder`` (noise off) to float64 rounding; (2) the same layers pushed in
chunks of random sizes and flushed equal them given the whole signal (noise on, a function of
position); then prints, per layer, the samples a one-frame push computes and the state it keeps.

    python scripts/experiments/per_layer_state.py
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from snac.layers import Decoder
from torch.nn.utils import remove_weight_norm


def noise_at(positions: torch.Tensor, salt: int) -> torch.Tensor:
    """Deterministic noise [T] per absolute sample position (as the engine's keyed noise is)."""
    x = torch.sin(positions.double() * 12.9898 + salt * 78.233) * 43758.5453
    return (x - torch.floor(x)) * 2 - 1


def no_noise(positions: torch.Tensor, salt: int) -> torch.Tensor:
    return torch.zeros(positions.shape, dtype=torch.float64)


def snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


class Layer:
    """A streaming layer: ``push(x)`` takes new inputs [C, n] and returns the outputs now final;
    ``computed`` counts the output samples computed so far."""

    computed = 0

    def push(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def push_end(self) -> torch.Tensor:
        """The outputs the end of the signal makes final (right zero padding)."""
        raise NotImplementedError

    def state_samples(self) -> int:
        return 0


class Pointwise(Layer):
    def __init__(self, fn, channels_out: int) -> None:
        self.fn, self.channels_out = fn, channels_out

    def push(self, x):
        self.computed += x.shape[1]
        return self.fn(x)

    def push_end(self):
        return torch.zeros(self.channels_out, 0, dtype=torch.float64)


class Conv(Layer):
    """A conv with symmetric zero padding p = (k - 1) * d / 2: keeps its last (k - 1) * d inputs."""

    def __init__(self, conv: torch.nn.Conv1d) -> None:
        self.weight, self.bias, self.d, self.groups = conv.weight.double(), conv.bias.double(), conv.dilation[0], conv.groups
        self.span = (conv.kernel_size[0] - 1) * self.d
        self.state = torch.zeros(conv.in_channels, self.span // 2, dtype=torch.float64)  # the left padding

    def push(self, x):
        buffer = torch.cat([self.state, x], 1)
        if buffer.shape[1] <= self.span:  # no output final yet
            self.state = buffer
            return torch.zeros(self.weight.shape[0], 0, dtype=torch.float64)
        out = F.conv1d(buffer[None], self.weight, self.bias, dilation=self.d, groups=self.groups)[0]
        self.state = buffer[:, buffer.shape[1] - self.span:] if self.span else buffer[:, :0]
        self.computed += out.shape[1]
        return out

    def push_end(self):
        return self.push(torch.zeros(self.state.shape[0], self.span // 2, dtype=torch.float64))

    def state_samples(self):
        return self.span


class ConvTranspose(Layer):
    """SNAC's upsampling (kernel 2s, stride s, padding ceil(s/2), output padding s % 2, s even here):
    output n = full[n + s/2], full[m] from inputs m // s and m // s - 1; keeps its last input frame."""

    def __init__(self, conv: torch.nn.ConvTranspose1d) -> None:
        self.weight, self.bias, self.s = conv.weight.double(), conv.bias.double(), conv.stride[0]
        assert self.s % 2 == 0 and conv.padding[0] == self.s // 2
        self.previous = torch.zeros(conv.in_channels, 1, dtype=torch.float64)  # input -1: zero
        self.emitted = 0  # outputs emitted so far
        self.seen = 0  # inputs seen so far

    def push(self, x):
        if x.shape[1] == 0:
            return torch.zeros(self.weight.shape[1], 0, dtype=torch.float64)
        buffer = torch.cat([self.previous, x], 1)  # inputs seen - 1 .. seen + n - 1
        full = F.conv_transpose1d(buffer[None], self.weight, self.bias, stride=self.s)[0]  # full[m'] for m' from (seen - 1) * s
        self.seen += x.shape[1]
        final = self.seen * self.s - self.s // 2  # outputs n < final have both their inputs
        first_m = (self.seen - x.shape[1] - 1) * self.s  # full's index 0 is this m
        out = full[:, self.emitted + self.s // 2 - first_m: final + self.s // 2 - first_m]
        self.emitted, self.previous = final, x[:, -1:]
        self.computed += out.shape[1]
        return out

    def push_end(self):
        # the last s/2 outputs see input `seen` as zero (the transposed conv's own end)
        out = F.conv_transpose1d(torch.cat([self.previous, torch.zeros_like(self.previous)], 1)[None],
                                 self.weight, self.bias, stride=self.s)[0]
        first_m = (self.seen - 1) * self.s
        tail = out[:, self.emitted + self.s // 2 - first_m: self.seen * self.s + self.s // 2 - first_m]
        self.computed += tail.shape[1]
        return tail

    def state_samples(self):
        return 1


class Noise(Layer):
    def __init__(self, block, salt: int, noise) -> None:
        self.linear, self.salt, self.noise, self.position = block.linear, salt, noise, 0

    def push(self, x):
        if x.shape[1] == 0:
            return x
        h = F.conv1d(x[None], self.linear.weight.double())[0]
        n = self.noise(torch.arange(self.position, self.position + x.shape[1]), self.salt)[None]
        self.position += x.shape[1]
        self.computed += x.shape[1]
        return x + n * h

    def push_end(self):
        return torch.zeros(self.linear.weight.shape[0], 0, dtype=torch.float64)


class Residual(Layer):
    """x + branch(x): the branch lags its input by its padding; the skip path waits in a queue."""

    def __init__(self, unit) -> None:
        snake1, conv, snake2, pointwise = unit.block
        self.layers = [snake_layer(snake1), Conv(conv), snake_layer(snake2), Conv(pointwise)]
        self.skip = torch.zeros(conv.in_channels, 0, dtype=torch.float64)

    def push(self, x):
        self.skip = torch.cat([self.skip, x], 1)
        y = x
        for layer in self.layers:
            y = layer.push(y)
        return self._join(y)

    def push_end(self):
        y = self.layers[1].push_end()  # the snake before it has no tail of its own
        for layer in self.layers[2:]:
            y = layer.push(y)
        return self._join(y)

    def _join(self, y):
        out, self.skip = self.skip[:, :y.shape[1]] + y, self.skip[:, y.shape[1]:]
        self.computed += y.shape[1]
        return out

    def state_samples(self):
        return self.layers[1].state_samples() + self.layers[1].span // 2  # the conv's inputs and the skip queue


def snake_layer(module) -> Pointwise:
    return Pointwise(lambda x, a=module.alpha.double()[0]: snake(x, a), module.alpha.shape[1])


def layers_of(decoder: Decoder, noise=noise_at) -> list[tuple[str, Layer]]:
    """The decoder as streaming layers, named; ``noise(positions, salt)`` for its NoiseBlocks."""
    out, salt = [], 0
    for index, module in enumerate(decoder.model):
        name = type(module).__name__
        if name.endswith("Conv1d"):
            out.append((f"{index}:conv k={module.kernel_size[0]}", Conv(module)))
        elif name == "Snake1d":
            out.append((f"{index}:snake", snake_layer(module)))
        elif name == "Tanh":
            out.append((f"{index}:tanh", Pointwise(torch.tanh, 1)))
        elif name == "DecoderBlock":
            for sub in module.block:
                kind = type(sub).__name__
                if kind == "Snake1d":
                    out.append((f"{index}:snake", snake_layer(sub)))
                elif kind.endswith("Transpose1d"):
                    out.append((f"{index}:transposed x{sub.stride[0]}", ConvTranspose(sub)))
                elif kind == "NoiseBlock":
                    salt += 1
                    out.append((f"{index}:noise", Noise(sub, salt, noise)))
                else:
                    out.append((f"{index}:unit d={sub.block[1].dilation[0]}", Residual(sub)))
        else:
            raise ValueError(f"no streaming form for {name}")
    return out


def stream(layers: list[tuple[str, Layer]], chunks: list[torch.Tensor]) -> torch.Tensor:
    """Push each chunk of latent frames [C, n] through the layers, then flush them in order (each
    layer's tail runs through the layers after it); returns all the audio."""
    pieces = []
    for x in chunks:
        for _, layer in layers:
            x = layer.push(x)
        pieces.append(x)
    for i, (_, layer) in enumerate(layers):
        tail = layer.push_end()
        for _, later in layers[i + 1:]:
            tail = later.push(tail)
        pieces.append(tail)
    return torch.cat(pieces, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=37, help="latent frames of the signal")
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args()
    torch.manual_seed(cli.seed)
    config = dict(input_channel=768, channels=1024, rates=[8, 8, 4, 2], noise=True, depthwise=True, attn_window_size=None)
    decoder = Decoder(**config).double().eval()
    for module in decoder.modules():
        try:
            remove_weight_norm(module)
        except (ValueError, AttributeError):
            pass
        if hasattr(module, "alpha"):
            module.alpha.data.uniform_(0.3, 2.0)
        if hasattr(module, "bias") and module.bias is not None:
            module.bias.data.normal_(0, 0.05)
    z = torch.randn(768, cli.frames, dtype=torch.float64)
    with torch.no_grad():
        # (1) this script's layers against upstream's forward, noise off
        real_randn = torch.randn
        torch.randn = lambda *a, **k: torch.zeros(*a, **{k2: v for k2, v in k.items() if k2 in ("dtype", "device")})
        try:
            upstream = decoder(z[None])[0]
        finally:
            torch.randn = real_randn
        mine = stream(layers_of(decoder, no_noise), [z])
        upstream_error = float((mine - upstream).abs().max() / upstream.abs().max())
        # (2) pushed in chunks of random sizes against the whole signal at once, noise on
        reference = stream(layers_of(decoder), [z])
        sizes = torch.randint(1, 5, (cli.frames,), generator=torch.Generator().manual_seed(cli.seed + 1)).tolist()
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        streamed = stream(layers_of(decoder), [z[:, a:a + n] for a, n in zip(starts, sizes) if a < cli.frames])
        stream_error = float((streamed - reference).abs().max() / reference.abs().max())
        # (3) one-frame pushes in steady state: samples each layer computes a push
        layers = layers_of(decoder)
        for f in range(24):
            x = z[:, f:f + 1]
            for _, layer in layers:
                x = layer.push(x)
        before = [layer.computed for _, layer in layers]
        x = z[:, 24:25]
        for _, layer in layers:
            x = layer.push(x)
        per_push = [(name, layer.computed - b, layer.state_samples()) for (name, layer), b in zip(layers, before)]
    per_stream = sum(state * channels for (_, _, state), channels in zip(per_push, layer_channels(layers)))
    print(json.dumps({"frames": cli.frames, "upstream_vs_these_layers_rel_error": upstream_error,
                      "stream_vs_whole_rel_error": stream_error, "stream_samples": streamed.shape[1],
                      "whole_samples": reference.shape[1], "state_values_per_stream": per_stream,
                      "state_kib_per_stream_fp16": round(per_stream * 2 / 1024, 1)}))
    print("layer, samples computed by a one-latent-frame push (an Orpheus frame is 4), state samples kept, channels")
    for (name, computed, state), channels in zip(per_push, layer_channels(layers)):
        print(f"  {name:24s} {computed:6d} {state:6d} {channels:6d}")


def layer_channels(layers: list) -> list[int]:
    """The channels of each layer's state (its input's)."""
    out = []
    for _, layer in layers:
        if isinstance(layer, Conv):
            out.append(layer.state.shape[0])
        elif isinstance(layer, ConvTranspose):
            out.append(layer.previous.shape[0])
        elif isinstance(layer, Residual):
            out.append(layer.skip.shape[0])
        else:  # pointwise layers and the noise keep no state
            out.append(0)
    return out


if __name__ == "__main__":
    main()
