"""One batched step through a stream engine's stages, on device tensors only (what a CUDA graph
captures): each stage runs its layers on ``[context | new]`` and keeps the outputs whose whole
receptive field lay inside that buffer (the package docstring of :mod:`snac_fast.streaming`)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from snac_fast.model.noise import patched_noise
from snac_fast.ops.context import context_step
from snac_fast.ops.launch import launches_as_recorded, tiles_as_for_fewer_rows
from snac_fast.ops.noise import keyed_normal
from snac_fast.streaming.shapes import CODELESS, PREFILL, STEP, TAIL
from snac_fast.streaming.step_graph import NoiseCall

# steps of up to this many rows take the 1-row step's tiles: warming 256 streams compiles fewer kernel
# variants for 8-30% more GPU time at 2-8 rows (docs/batching.md, docs/measurements.md)
ONE_ROW_TILES_UP_TO = 8


class StageForward:
    """A stream engine's step itself: ``model``'s decoder cut into ``geometry``'s stages over the
    per-slot ``state`` (or, with ``layered``, the per-layer states of a CPU's exact streams). Calling
    it runs one batched step on device tensors; it keeps, per row count, the kernel launches the
    one-group step recorded (which the other steps of that many rows reuse)."""

    def __init__(self, model, geometry, state: list[Tensor], layered=None, tail_keep: list[int] | None = None) -> None:
        self.model, self.geometry, self.state, self.layered, self.tail_keep = model, geometry, state, layered, tail_keep
        self.launches: dict[int, dict] = {}
        # a step of more rows runs its stages on slices of at most this many rows in turn (None: all
        # at once): its intermediates, and so the step graphs' pool, are a slice's; each row's audio
        # and state are the same, its rows being independent. Set by the engine (StreamEngine.rows_per_pass)
        self.rows_per_pass: int | None = None

    def __call__(self, kind: str, keys: Tensor, codes: list[Tensor], frames: int,
                 noise_for: Callable[[NoiseCall], Tensor] | None = None) -> Tensor:
        """The step itself, on device tensors only (what a CUDA graph captures). keys: int64
        [4, B] (state slot, frames consumed, seed, row); codes: per level [B, L_i] (not for flush).
        noise_for: where NoiseBlocks get their noise (default: :meth:`draw_noise`). Returns the
        rows' new audio, [B, 1, samples] in the state's dtype."""
        rows = keys.shape[1]
        slice_rows = self.rows_per_pass
        if slice_rows is not None and rows > slice_rows and self.layered is None:
            return torch.cat([self(kind, keys[:, rows_of], [c[rows_of] for c in codes], frames,
                                   _rows_of_noise(noise_for, rows_of))
                              for rows_of in (slice(i, i + slice_rows) for i in range(0, rows, slice_rows))])
        recording = kind == STEP and frames == self.geometry.group
        with tiles_as_for_fewer_rows(rows if rows <= ONE_ROW_TILES_UP_TO else 1), \
                launches_as_recorded(self.launches.setdefault(rows, {}), recording):
            return self._forward_rows(kind, keys, codes, frames, noise_for)

    def _forward_rows(self, kind: str, keys: Tensor, codes: list[Tensor], frames: int,
                      noise_for: Callable[[NoiseCall], Tensor] | None) -> Tensor:
        geo = self.geometry
        slots = keys[0]
        new = self.model.quantizer.from_codes(codes) if kind not in CODELESS else None
        if self.layered is not None:
            return self.layered.forward(kind, keys, new)
        offsets: dict[int, tuple[int, int]] = {}  # NoiseBlock index -> (samples per frame, start)
        noise_for = noise_for or (lambda call: self.draw_noise(keys, call))

        def noise(index: int, x: Tensor) -> Tensor:
            return noise_for(NoiseCall(index, *offsets[index], x.shape[2], x.dtype))

        with patched_noise(self.model, noise):
            for l, (stage, state) in enumerate(zip(geo.stages, self.state)):
                a, b, H = geo.a[l], geo.b[l], stage.context
                n = new.shape[2] if new is not None else 0
                if kind == PREFILL:  # the buffer starts at sample 0: the layers pad the left edge
                    buffer, start = new, 0
                    valid = (0, n - stage.right)
                    state.index_copy_(0, slots, new[:, :, n - H:])  # a prefill holds at least H samples
                elif new is None:  # flush, first stage: the context alone, up to the stream's last sample
                    buffer, start = state.index_select(0, slots), b - H
                    valid = (H - stage.right, H)
                else:  # [context | new], from position P - H, with P = a * F + b; the state keeps the last H
                    buffer = context_step(state, slots, new, channels_last=new.stride(1) == 1 and new.shape[1] > 1)
                    start = b - H
                    valid = (H - stage.right, H + n - stage.right if kind == STEP else H + n)
                for index, scale in stage.noise:
                    offsets[index] = (a * scale if kind != PREFILL else 0, start * scale)
                x = buffer
                for layer in stage.layers:
                    x = layer(x)
                s = stage.upsample
                x = x[:, :, valid[0] * s:valid[1] * s]
                if kind == TAIL:
                    x = x[:, :, :self.tail_keep[l]]
                for layer in stage.post:
                    x = layer(x.contiguous())
                new = x
        return new

    @staticmethod
    def draw_noise(keys: Tensor, call: "NoiseCall", out: Tensor | None = None) -> Tensor:
        """A step's keyed noise for one NoiseBlock (keys as in :meth:`_forward`): [B, 1, length] in
        ``call.dtype``, written into ``out`` where given."""
        return keyed_normal(keys[2], keys[3], keys[1], call.per_frame, call.start, call.length, call.index,
                            dtype=call.dtype, out=out)


def _rows_of_noise(noise_for: Callable[[NoiseCall], Tensor] | None, rows: slice) -> Callable[[NoiseCall], Tensor] | None:
    """A slice of a step's rows' noise source: ``noise_for`` gives all the step's rows (a graph's
    noise buffers); None stays None (the slice's own keys then draw its noise)."""
    if noise_for is None:
        return None
    return lambda call: noise_for(call)[rows]
