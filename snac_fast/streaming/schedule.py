"""A stream engine's schedule: the codes its streams hold, decoded as prefills, steps and flushes
batched per kind and size (the steady state's steps straight from the pushed codes)."""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch
from torch import Tensor

from snac_fast.ops.device import device_scope
from snac_fast.streaming.shapes import CODELESS, FLUSH, PREFILL, STEP, slots_of


# A CPU call's default bound in stream-frames: past 8 a call gains under 2% a stream-frame on one
# or two threads (24 kHz: 17.8 -> 17.9 ms one thread, 9.8 -> 9.8 ms two, at 8 -> 16), while its
# live memory grows with every one (docs/streaming.md)
CPU_CALL_FRAMES = 8


def checked_call_frames(frames: int | None, device: torch.device, timing) -> int | None:
    """An engine's ``max_call_frames`` checked: the most stream-frames (streams x frames) one call
    decodes, in whole groups (``timing``: its :class:`~.lookahead.StreamTiming`), a prefill at least.
    A round that holds more runs as several calls, each stream's audio the same: a bound on a CPU
    call's live memory (~3.6 MB a stream-frame at 24 kHz in float32). None: :data:`CPU_CALL_FRAMES`
    on a CPU (or a prefill's frames where more), no bound on a GPU (a call there replays a captured
    graph of one batch bucket)."""
    least = timing.prefill_frames
    if frames is None:
        return max(CPU_CALL_FRAMES, least) if device.type == "cpu" else None
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < least:
        raise ValueError(f"max_call_frames must be an int of at least {least} (a stream's prefill), got {frames!r}")
    return frames // timing.frames_per_group * timing.frames_per_group


class Schedule:
    """Decodes what a :class:`~snac_fast.streaming.StreamEngine`'s streams hold (a part of the
    engine, called under its lock): ``pending`` codes (:class:`~.pending.PendingCodes`) of the state
    rows in ``slots`` (:class:`~.slots.SlotTable`), run through ``steps``
    (:class:`~.step_runner.StepRunner`) in chunks of at most ``slots.max_streams`` streams and,
    where ``call_frames`` is set, at most that many stream-frames a call (a bound on a call's
    memory); ``model`` decodes a stream that ends before its prefill whole."""

    def __init__(self, model, timing, slots, pending, steps, checks, call_frames: int | None = None) -> None:
        self.model, self.timing, self.slots, self.pending, self.steps, self.checks = \
            model, timing, slots, pending, steps, checks
        self.call_frames = call_frames
        self.device, self.dtype = steps.device, steps.dtype

    def empty_audio(self) -> Tensor:
        return torch.empty(0, device=self.device, dtype=self.dtype)

    def steady(self, streams: int, slots: np.ndarray, frames: int) -> bool:
        """A server's steady state for ``streams`` started streams (``slots``): none holding pending
        frames, and ``frames`` one step's worth for one batch."""
        pending = self.pending
        return (streams <= self.slots.max_streams and self.steps.step_frames(frames) == frames
                and (self.call_frames is None or streams * frames <= self.call_frames)
                and self.steps.runnable_frames(streams, frames) == frames
                and (pending.frames_held == 0 or not (pending.tail[slots] != pending.head[slots]).any()))

    def direct(self, slots: np.ndarray, codes: list[np.ndarray], frames: int, ids_checked: bool = False,
               keys: np.ndarray | None = None) -> Tensor:
        """In the steady state, the codes (per level [len(slots), L_i], any integer dtype) go
        straight into one batched step, without the pending buffers (:meth:`StepRunner.replay`
        where its graph is captured); returns the audio [n, samples]. ``keys``: the batch's key rows
        where known (:meth:`StepRunner.replay`)."""
        audio = self.steps.replay(slots, codes, frames, ids_checked, keys)
        if audio is not None:
            return audio
        if not ids_checked:
            self.checks.check_ids([codes])
        codes = [c.astype(np.int64, copy=False) for c in codes]
        with torch.inference_mode(), device_scope(self.device):
            return self.run(STEP, slots, frames, codes)

    def decode(self, pushed: list, finish: list) -> dict:
        """Decode what the ``pushed`` streams hold (prefills, steps) and all that the ``finish``
        streams hold (their flushes): stream -> its new audio (1-D; streams may share an empty one).
        The caller releases the finished streams' slots."""
        pieces: dict = {s: [] for s in pushed + finish}
        prefill = self.timing.prefill_frames
        with torch.inference_mode(), device_scope(self.device):
            self._prefills([s for s in pieces if not s.started and s.pending_frames >= prefill], pieces)
            self._steps([s for s in pieces if s.started], pieces)
            self._finishes(finish, pieces)
        empty = None
        out = {}
        for s, p in pieces.items():
            if len(p) == 1:
                out[s] = p[0]
            elif p:
                out[s] = torch.cat(p)
            else:
                out[s] = empty = self.empty_audio() if empty is None else empty
        return out

    def _prefills(self, streams: list, pieces) -> None:
        for chunk in self._chunks(streams, self.timing.prefill_frames):
            audio = self.run(PREFILL, slots_of(chunk), self.timing.prefill_frames).unbind(0)
            for s, a in zip(chunk, audio):
                s.started = True
                pieces[s].append(a)

    def _steps(self, streams: list, pieces) -> None:
        pending = self.pending
        while streams:
            slots = slots_of(streams)
            frames = self.steps.step_frames_of(pending.tail[slots] - pending.head[slots])
            # the distinct step sizes, without np.unique: its first call imports numpy.ma (a stall,
            # seen as the first prefills' slow pushes under load; docs/measurements.md)
            for k in sorted(set(frames[frames > 0].tolist())):
                picked = np.flatnonzero(frames == k)
                group = streams if len(picked) == len(streams) else [streams[i] for i in picked]
                for chunk in self._chunks(group, k):
                    step = self.steps.runnable_frames(len(chunk), k)
                    for s, a in zip(chunk, self.run(STEP, slots_of(chunk), step).unbind(0)):
                        pieces[s].append(a)
            # streams that pushed more than one step's frames go round again
            more = (frames > 0) & (pending.tail[slots] - pending.head[slots] >= self.timing.frames_per_group)
            streams = [streams[i] for i in np.flatnonzero(more)]

    def _finishes(self, streams: list, pieces) -> None:
        started = [s for s in streams if s.started]
        # a flush pushes at most a prefill's frames of zeros (the lookahead's reach)
        for chunk in self._chunks(started, self.timing.prefill_frames):
            for s, a in zip(chunk, self.run(FLUSH, slots_of(chunk), 0).unbind(0)):
                pieces[s].append(a)
        for s in streams:
            if not s.started and s.pending_frames:  # shorter than a prefill: decode it whole
                pieces[s].append(self.decode_held(s))

    def _chunks(self, streams: list, frames: int) -> Iterable[list]:
        """``streams`` in calls of at most ``slots.max_streams`` streams and ``call_frames``
        stream-frames (each stream taking ``frames``)."""
        step = self.slots.max_streams
        if self.call_frames is not None:
            step = max(1, min(step, self.call_frames // frames))
        return (streams[i:i + step] for i in range(0, len(streams), step))

    def decode_held(self, s, take: bool = True) -> Tensor:
        """The whole decode of the codes stream ``s`` holds (taking them, unless not ``take``): [samples]."""
        from snac_fast.model.noise import keyed_noise

        held = self.pending.take_all(s.slot) if take else self.pending.peek_all(s.slot)
        codes = [torch.from_numpy(c)[None].to(self.device) for c in held]
        seeds = torch.tensor([s.seed], dtype=torch.int64, device=self.device)
        rows = torch.tensor([s.row], dtype=torch.int64, device=self.device)
        with keyed_noise(self.model, seeds, rows):
            return self.model.decode(codes)[0, 0]

    def run(self, kind: str, slots: np.ndarray, frames: int, codes: list[np.ndarray] | None = None) -> Tensor:
        """Run one kind of step for the streams of state ``slots``, each taking its next ``frames``
        pending frames (none for a flush), or ``codes`` (per level int64 [len(slots), L_i]) when
        given instead; returns the streams' new audio, [len(slots), samples] (row j: slots[j])."""
        keys = self.slots.keys_of(slots, self.steps.bucket(len(slots)))  # frames consumed before this step
        if kind not in CODELESS:
            codes = self.pending.take(slots, frames) if codes is None else codes  # n rows
            self.slots.consumed[slots] += frames
        else:
            codes = []
        return self.steps.run(kind, keys, codes, frames, len(slots))
