"""A stream engine's facts of time (:class:`StreamTiming`: how far its audio trails its newest
frame, when its first audio comes) and, for approximate streams (a lookahead below the receptive
field), what each call emits (:class:`ApproximateEmission`): the exact audio, then a tail decoded
from a copy of the state as if the stream ended there."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import Tensor

from snac_fast.ops.device import device_scope
from snac_fast.streaming.geometry import Geometry
from snac_fast.streaming.shapes import slots_of

# lookahead="fp16": per sampling rate, the least lookahead (samples) whose approximate stream is
# closer to the whole float32 decode than an fp16 decode is (scripts/lookahead_curve.py, docs/streaming.md)
FP16_LOOKAHEAD = {24000: 3456, 32000: 12032, 44100: 12032}


def preset_lookahead(config: dict, name: str) -> int | None:
    """A named lookahead for a model's ``config``: ``"fp16"`` (:data:`FP16_LOOKAHEAD`; None, the
    exact stream, for a sampling rate it was not measured at) or ``"exact"`` (None)."""
    if name == "exact":
        return None
    if name != "fp16":
        raise ValueError(f"lookahead must be samples (an int), None, 'fp16' or 'exact'; got {name!r}")
    return FP16_LOOKAHEAD.get(int(config["sampling_rate"]))


class StreamTiming:
    """A stream engine's facts of time: its stages' ``geometry`` at ``sampling_rate``, the samples of
    its exact lookahead (``exact_lookahead_samples``, the receptive field) and, for approximate
    streams, the lookahead asked for (``approximate_lookahead``, samples; None: exact)."""

    def __init__(self, geometry: Geometry, sampling_rate: int, exact_lookahead_samples: int,
                 approximate_lookahead: int | None) -> None:
        self.geometry, self.sampling_rate = geometry, sampling_rate
        self.exact_lookahead_samples, self.approximate_lookahead = exact_lookahead_samples, approximate_lookahead

    def tail_lengths(self, window: int | None) -> list[int]:
        """Per stage, the outputs past its exact point that a tail run keeps: those the emission,
        L samples before the stream's end, needs, traced back through the stages: k outputs past a
        stage's exact point read ceil(k / upsample) inputs past its state (its right context covers
        their reach), whole attention windows where a stage ends in one. The later stages never read
        what is cut (tests: equal to whole decodes to 1e-10 in float64; 3 samples fewer fail)."""
        need = self.exact_lookahead_samples - self.approximate_lookahead  # audio past the exact end
        keep = [0] * len(self.geometry.stages)
        for l in reversed(range(len(self.geometry.stages))):
            stage = self.geometry.stages[l]
            if stage.post and window:
                need = -(-need // window) * window
            keep[l] = need
            need = -(-need // stage.upsample)
        return keep

    @property
    def frames_per_group(self) -> int:
        """Frames a step takes at a time (1 at 24 kHz; an attention window's worth at 32/44 kHz)."""
        return self.geometry.group

    @property
    def prefill_frames(self) -> int:
        """Frames a stream collects before its first audio."""
        return self.geometry.prefill_frames

    @property
    def samples_per_frame(self) -> int:
        return self.geometry.a[-1]

    @property
    def lookahead_samples(self) -> int:
        """Audio a stream's output trails its newest frame by (the exact receptive field, or the
        approximate lookahead asked for)."""
        if self.approximate_lookahead is not None:
            return self.approximate_lookahead
        return self.geometry.lookahead_samples

    @property
    def first_audio_frames(self) -> int:
        """Frames a stream must push before its first audio: the prefill for exact streams; for
        approximate ones the fewest whole attention windows (groups) whose audio passes the lookahead."""
        if self.approximate_lookahead is None:
            return self.prefill_frames
        frames = self.approximate_lookahead // self.samples_per_frame + 1
        return -(-frames // self.frames_per_group) * self.frames_per_group

    @property
    def first_audio_ms(self) -> float:
        """Audio time of :attr:`first_audio_frames` (what an LM generating in real time waits for)."""
        return self.ms(self.first_audio_frames * self.samples_per_frame)

    @property
    def lookahead_ms(self) -> float:
        return self.ms(self.lookahead_samples)

    @property
    def lookahead_frames(self) -> float:
        return self.lookahead_samples / self.samples_per_frame

    def ms(self, samples: int) -> float:
        return 1000.0 * samples / self.sampling_rate


class ApproximateEmission:
    """What approximate streams emit (a part of an engine whose ``timing`` has an approximate
    lookahead L): per state slot, the exact audio produced so far and the audio emitted (samples).
    ``state``: the engine's state tensors; ``run_tail``: a tail run for some slots (int64 numpy)
    -> their audio [n, samples], advancing their state (restored after); ``decode_held``: a stream
    -> the whole decode of the codes it holds, without taking them, [samples]."""

    def __init__(self, timing: StreamTiming, slots: int, state: list[Tensor],
                 run_tail: Callable[[np.ndarray], Tensor], decode_held: Callable[..., Tensor]) -> None:
        self.timing, self.state, self.run_tail, self.decode_held = timing, state, run_tail, decode_held
        self.exact_out = np.zeros(slots, np.int64)
        self.emitted = np.zeros(slots, np.int64)

    def reset(self, slot: int) -> None:
        self.exact_out[slot] = self.emitted[slot] = 0

    def emit(self, streams: list, exact: list[Tensor], finishing: set) -> list[Tensor]:
        """Under the engine's lock, after an exact call: each stream's exact new audio (``exact[j]``,
        continuing its earlier exact audio) -> the audio it emits now. A stream's output runs to L
        samples before its newest decoded frame, from the decode of all its codes as if it ended
        there: its exact audio, then a flush of a copy of its state (restored after); before its
        prefill, a whole decode of the codes it holds. A flush emits all that is left."""
        timing = self.timing
        L, per_frame, group = timing.approximate_lookahead, timing.samples_per_frame, timing.frames_per_group
        running = [s for s in streams if s not in finishing and s.started]
        tails: dict = {}
        device = self.state[0].device
        if running:
            slots = slots_of(running)
            with torch.inference_mode(), device_scope(device):
                index = torch.from_numpy(slots).to(device)
                saved = [state.index_select(0, index) for state in self.state]
                tails = dict(zip(running, self.run_tail(slots).unbind(0)))
                for state, rows in zip(self.state, saved):
                    state.index_copy_(0, index, rows)
        out = []
        for s, piece in zip(streams, exact):
            before, emitted = int(self.exact_out[s.slot]), int(self.emitted[s.slot])
            self.exact_out[s.slot] = before + piece.numel()
            if s in finishing:
                out.append(piece[emitted - before:])
                continue
            if s in tails:  # exact audio from `before`, then the tail from `after` to the last frame decoded
                after, end = before + piece.numel(), max(emitted, s.frames * per_frame - L)  # end >= after
                if emitted >= after:  # all in the tail (pushes shorter than the exact lookahead less L)
                    out.append(tails[s][emitted - after:end - after])
                else:
                    out.append(torch.cat([piece[emitted - before:], tails[s][:end - after]]))
            else:  # not started: the whole decode of what it holds, in whole attention windows
                frames = s.pending_frames
                if not frames or frames % group:
                    out.append(piece.new_empty(0))
                    continue
                end = max(emitted, frames * per_frame - L)
                with torch.inference_mode(), device_scope(device):
                    out.append(self.decode_held(s)[emitted:end])
            self.emitted[s.slot] = end
        return out
