"""Lookahead geometry of a stream engine: how far its audio trails its newest frame, when its first
audio comes, and, for approximate streams (a lookahead below the receptive field), what each call
emits: the exact audio, then a tail decoded from a copy of the state as if the stream ended there."""

from __future__ import annotations

import torch
from torch import Tensor

from snac_fast.ops.device import device_scope
from snac_fast.streaming.shapes import TAIL, slots_of

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


class LookaheadGeometry:
    """The :class:`~snac_fast.streaming.StreamEngine`'s facts of time and its approximate emission
    (a part of the engine: it reads the engine's geometry, config and per-slot counters)."""

    def _tail_lengths(self, window: int | None) -> list[int]:
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
        return self._ms(self.first_audio_frames * self.samples_per_frame)

    @property
    def lookahead_ms(self) -> float:
        return self._ms(self.lookahead_samples)

    def _ms(self, samples: int) -> float:
        return 1000.0 * samples / int(self.config["sampling_rate"])

    @property
    def lookahead_frames(self) -> float:
        return self.lookahead_samples / self.samples_per_frame

    @property
    def state_bytes_per_stream(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.state)

    @property
    def open_streams(self) -> int:
        return self.max_streams - len(self._free)

    def _emit(self, streams: list, exact: list[Tensor], finishing: set) -> list[Tensor]:
        """Approximate streams, under the lock, after an exact call: each stream's exact new audio
        (``exact[j]``, continuing its earlier exact audio) -> the audio it emits now. A stream's
        output runs to L samples before its newest decoded frame, from the decode of all its codes
        as if it ended there: its exact audio, then a flush of a copy of its state (restored after);
        before its prefill, a whole decode of the codes it holds. A flush emits all that is left."""
        L, per_frame, group = self.approximate_lookahead, self.samples_per_frame, self.frames_per_group
        running = [s for s in streams if s not in finishing and s.started]
        tails: dict = {}
        if running:
            slots = slots_of(running)
            with torch.inference_mode(), device_scope(self.device):
                index = torch.from_numpy(slots).to(self.device)
                saved = [state.index_select(0, index) for state in self.state]
                tails = dict(zip(running, self._run(TAIL, slots, 0).unbind(0)))
                for state, rows in zip(self.state, saved):
                    state.index_copy_(0, index, rows)
        out = []
        for s, piece in zip(streams, exact):
            before, emitted = int(self._exact_out[s.slot]), int(self._emitted[s.slot])
            self._exact_out[s.slot] = before + piece.numel()
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
                    out.append(self.empty_audio())
                    continue
                end = max(emitted, frames * per_frame - L)
                with torch.inference_mode(), device_scope(self.device):
                    out.append(self._decode_whole(s, take=False)[emitted:end])
            self._emitted[s.slot] = end
        return out
