"""The batched stream engine: state rows for many streams, prefill / step / flush runs, CUDA graphs.

:class:`StreamEngine` is the engine's streams and their scheduling; its parts live beside it, each
owning its state: :mod:`.slots` (state rows and noise keys), :mod:`.lookahead` (facts of time,
approximate emission), :mod:`.code_checks` (its inputs' checks), :mod:`.step_runner` (one batched
step through its graph, step sizes, the warm-up), :mod:`.stage_forward` (the step through the
stages, what a CUDA graph captures)."""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from snac_fast.batching.defaults import ROWS_PER_PASS
from snac_fast.model.noise import check_seed
from snac_fast.streaming.code_checks import CodeChecker, host_numpy
from snac_fast.streaming.geometry import Geometry, align_contexts, build_stages
from snac_fast.streaming.layer_state import LayerStates
from snac_fast.streaming.lookahead import ApproximateEmission, StreamTiming, preset_lookahead
from snac_fast.streaming.pending import CheckedCodes, PendingCodes
from snac_fast.streaming.shapes import TAIL, joined_audio, slots_of
from snac_fast.streaming.schedule import Schedule, checked_call_frames
from snac_fast.streaming.slots import SlotTable
from snac_fast.streaming.stage_forward import StageForward
from snac_fast.streaming.step_runner import StepRunner


@dataclass(eq=False)
class StreamSlot:
    """One stream's place in a :class:`StreamEngine` (its state row ``slot``) and noise key."""

    engine: "StreamEngine" = field(repr=False)
    slot: int
    seed: int
    row: int
    started: bool = False
    closed: bool = False

    @property
    def frames(self) -> int:
        """Frames decoded so far (prefill and steps)."""
        return self.engine.frames_decoded(self.slot)

    @property
    def pending_frames(self) -> int:
        """Frames pushed but not decoded yet."""
        return self.engine.frames_pending(self.slot)


@dataclass
class _StepBatch:
    """The streams of one :meth:`StreamEngine.step` call: their state ``slots`` (int64 [n]), the
    step's key rows (int64 [4, bucket], :meth:`SlotTable.write_keys`) and whether all have started."""

    slots: np.ndarray
    keys: np.ndarray
    started: bool


def _timing(name: str) -> property:
    """One of :class:`StreamTiming`'s facts, read through the engine."""
    return property(lambda engine: getattr(engine.timing, name), doc=getattr(StreamTiming, name).__doc__)


class StreamEngine:
    """Stateful streaming decode for many streams at once (one state row per stream) of a SNAC
    ``model`` (snac-fast's tree after surgery, or upstream's) with its ``config``, on ``device`` in
    ``dtype`` (the model's). Build it with :meth:`snac_fast.FastSNAC.stream_engine`.

    :meth:`open` a stream, then :meth:`advance` any set of streams with their new codes (and ends);
    each call returns every stream's audio that is now final. Rows are batched per kind of step;
    on CUDA each (kind, batch bucket, frames) shape replays a CUDA graph. Thread-safe: calls are
    serialized by ``lock`` (the codec's). ``lookahead``: None for exact streams; L samples, fewer
    than :attr:`exact_lookahead_samples`, for approximate ones (lower latency): the state stays exact
    and each call emits each stream's audio up to L samples before its newest frame, read from the
    decode of all its codes so far as if the stream ended there (a flush of a copy of its state:
    the convs' zero padding at the end, as a window decode pads); audio emitted is never revised.
    So an approximate stream is a window decode whose window holds every earlier frame.

    ``layered``: steps with state per layer (:mod:`.layer_state`: no context recomputed; torch ops),
    the default for a CPU's exact float32/float64 streams; else the stages' step (a GPU's, which
    also serves approximate streams and half dtypes). ``compile``: the per-layer step through
    torch.compile (a C++ compiler needed; each new step shape compiles first).

    ``max_call_frames``: the most stream-frames (streams x frames) one call through the model
    decodes, a bound on a CPU call's live memory (:func:`.schedule.checked_call_frames`; None: the device's default).

    ``rows_per_pass``: a step of more streams runs the stages on slices of at most this many in turn,
    inside its one graph (None: all at once): the step's intermediates, and so the step graphs'
    memory pool, are a slice's, for a little more GPU time; the audio is the same (default:
    :data:`snac_fast.batching.defaults.ROWS_PER_PASS`).
    """

    def __init__(self, model: nn.Module, config: dict, max_streams: int = 256, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, lookahead: int | str | None = None, cuda_graphs: bool = False,
                 max_frames_per_step: int = 8, max_graphs: int = 64, layered: bool | None = None, compile: bool = False,
                 max_call_frames: int | None = None, rows_per_pass: int | None = ROWS_PER_PASS, lock=None) -> None:
        if max_streams < 1:
            raise ValueError("max_streams must be at least 1")
        self.model, self.config = model, config
        self.device, self.dtype = torch.device(device), dtype
        self.checks = CodeChecker(config)
        self.strides, self.codebook_size, self.ratios = self.checks.strides, self.checks.codebook_size, self.checks.ratios
        stages = build_stages(model, self.strides[0])
        window = config.get("attn_window_size")
        exact = Geometry.of(stages, self.strides[0], window)
        self.exact_lookahead_samples = exact.lookahead_samples
        if isinstance(lookahead, str):
            lookahead = preset_lookahead(config, lookahead)
        if lookahead is not None and (isinstance(lookahead, bool) or not isinstance(lookahead, int)
                                      or not 0 <= lookahead <= exact.lookahead_samples):
            raise ValueError(f"lookahead must be an int of 0..{exact.lookahead_samples} samples (exact), got {lookahead!r}")
        # lookahead < exact: approximate streams, emitted from a flush of a copy of the exact state
        self.approximate_lookahead = lookahead if lookahead is not None and lookahead < exact.lookahead_samples else None
        align_contexts(stages, exact)  # its a and group: neither depends on the contexts
        self.geometry = Geometry.of(stages, self.strides[0], window)
        self.timing = StreamTiming(self.geometry, int(config["sampling_rate"]), exact.lookahead_samples,
                                   self.approximate_lookahead)
        self.max_streams = max_streams
        self.max_call_frames = checked_call_frames(max_call_frames, self.device, self.timing)
        if layered is None:  # a CPU's exact float32 streams: state per layer computes no context twice
            # (in bfloat16 its torch ops round every layer: 18 dB against float32 where the stages' give 26)
            layered = (self.device.type == "cpu" and self.approximate_lookahead is None
                       and dtype in (torch.float32, torch.float64))
        if layered and (self.approximate_lookahead is not None or cuda_graphs):
            raise ValueError("layered=True is for exact streams without CUDA graphs")
        if compile and not layered:
            raise ValueError("compile=True compiles the per-layer step of a CPU's exact streams (layered)")
        # row max_streams: scratch for the padding rows of a bucket
        self.layered = LayerStates(model, max_streams + 1, exact.lookahead_samples, self.strides[0],
                                   device=self.device, dtype=dtype, compile=compile) if layered else None
        if self.layered is not None:
            self.state = self.layered.states
        else:
            with torch.inference_mode(False):
                self.state = [torch.zeros((max_streams + 1, s.channels, s.context), device=self.device, dtype=self.dtype)
                              for s in self.geometry.stages]
        self.slots = SlotTable(max_streams)
        self.pending = PendingCodes(max_streams, self.ratios)
        self._lock = lock or threading.RLock()  # a codec's: its decodes patch the same NoiseBlocks
        tail_keep = self.timing.tail_lengths(window) if self.approximate_lookahead is not None else None
        # the step itself (what the step graphs capture), a part that owns its launch choices
        self.forward = StageForward(model, self.geometry, self.state, self.layered, tail_keep)
        self.steps = StepRunner(self.forward, self.state, self.slots, self.checks, self.timing,
                                max_frames_per_step=min(max_frames_per_step, self.max_call_frames or max_frames_per_step),
                                cuda_graphs=cuda_graphs, max_graphs=max_graphs, lock=self._lock)
        self.rows_per_pass = rows_per_pass
        self.schedule = Schedule(model, self.timing, self.slots, self.pending, self.steps, self.checks, self.max_call_frames)
        self.emission = None if self.approximate_lookahead is None else ApproximateEmission(
            self.timing, max_streams + 1, self.state, lambda slots: self.schedule.run(TAIL, slots, 0),
            lambda stream: self.schedule.decode_held(stream, take=False))
        self._step_batches: dict[tuple, _StepBatch] = {}  # step's streams -> their slots and keys

    frames_per_group = _timing("frames_per_group")
    prefill_frames = _timing("prefill_frames")
    samples_per_frame = _timing("samples_per_frame")
    lookahead_samples = _timing("lookahead_samples")
    lookahead_frames = _timing("lookahead_frames")
    lookahead_ms = _timing("lookahead_ms")
    first_audio_frames = _timing("first_audio_frames")
    first_audio_ms = _timing("first_audio_ms")

    @property
    def cuda_graphs(self) -> bool:
        """Whether steps replay captured CUDA graphs."""
        return self.steps.cuda_graphs

    @property
    def rows_per_pass(self) -> int | None:
        """The most streams a step's stages run at once (None: all of the step's)."""
        return self.forward.rows_per_pass

    @rows_per_pass.setter
    def rows_per_pass(self, rows: int | None) -> None:
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise ValueError(f"rows_per_pass must be None or an int >= 1, got {rows!r}")
        with self._lock:
            if rows != self.forward.rows_per_pass:
                self.steps.drop_graphs()  # captured with the old slices
                self.forward.rows_per_pass = rows

    @property
    def max_frames_per_step(self) -> int:
        return self.steps.max_frames_per_step

    @property
    def state_bytes_per_stream(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.state)

    @property
    def open_streams(self) -> int:
        return self.slots.in_use

    def warmup(self, max_batch: int | None = None, frames: Sequence[int] = (), compiled: bool = False) -> int:
        """Capture every step graph a server will run (:meth:`StepRunner.warmup`); returns how many."""
        return self.steps.warmup(max_batch, frames, compiled)

    def compile_steps(self, max_batch: int | None = None, frames: Sequence[int] = ()) -> None:
        """Compile the kernels :meth:`warmup` would capture, without capturing (:meth:`StepRunner.compile_steps`)."""
        self.steps.compile_steps(max_batch, frames)

    def intermediates(self, rows: int) -> int:
        """Bytes the largest step of ``rows`` rows allocates (:meth:`StepRunner.intermediates`). CUDA only."""
        return self.steps.intermediates(rows)

    # -- streams -------------------------------------------------------------------------------

    def open(self, seed: int | None = None, row: int = 0) -> StreamSlot:
        """A new stream. seed: its noise key (None: a random one; fresh noise like an unseeded
        decode); its audio equals row ``row`` of ``decode(codes, seed=seed)``."""
        seed = secrets.randbits(63) if seed is None else check_seed(seed)
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < 1 << 31:
            raise ValueError(f"row must be an int in [0, 2**31), got {row!r}")
        with self._lock:
            slot = self.slots.take(seed, row)
            self.pending.clear(slot)
            if self.emission is not None:
                self.emission.reset(slot)
            return StreamSlot(self, slot, seed, row)

    def close(self, stream: StreamSlot) -> None:
        """Release a stream's slot without decoding what it still holds."""
        with self._lock:
            if not stream.closed:
                stream.closed = True
                self._step_batches.clear()
                self.pending.clear(stream.slot)
                self.slots.release(stream.slot)

    def advance(self, pushes: Mapping[StreamSlot, Sequence[Tensor]] | None = None,
                finish: Iterable[StreamSlot] = ()) -> dict[StreamSlot, Tensor]:
        """Take new codes for some streams (each checked before any kernel runs) and end others
        (``finish``: decode all they hold, release their slots). Returns, for every stream named,
        its audio that became final: a 1-D tensor on the engine's device, possibly empty (streams
        of one call may share an output buffer)."""
        finish = list(dict.fromkeys(finish))
        if self.approximate_lookahead is None:
            return self._advance(pushes or {}, finish)
        with self._lock:
            exact = self._advance(pushes or {}, finish)
            return dict(zip(exact, self.emission.emit(list(exact), list(exact.values()), set(finish))))

    def _advance(self, pushes: Mapping[StreamSlot, Sequence[Tensor]], finish: list[StreamSlot]) -> dict[StreamSlot, Tensor]:
        """:meth:`advance` of exact streams (the exact audio of approximate ones)."""
        checked = {s: self.checks.check_shapes(c) for s, c in pushes.items()}
        with self._lock:
            all_started = self._check_streams(list(checked) + finish)
            for s in finish:
                held = s.pending_frames + (checked[s].frames if s in checked else 0)
                if held % self.frames_per_group:
                    raise ValueError(f"a stream of this model must end on a multiple of {self.frames_per_group} frames "
                                     f"(its attention windows); this one ends with {s.frames + held}")
            streams = list(checked)
            codes = list(checked.values())
            slots = slots_of(streams)
            if (all_started and not finish and len({c.frames for c in codes}) == 1
                    and self.schedule.steady(len(streams), slots, codes[0].frames)):
                arrays = [level[None] for level in codes[0]] if len(codes) == 1 else [np.stack(c) for c in zip(*codes)]
                ids_checked = all(c.ids_checked for c in codes)  # check_codes' output: checked once already
                return dict(zip(streams, self.schedule.direct(slots, arrays, codes[0].frames, ids_checked).unbind(0)))
            self.checks.check_ids([c for c in codes if not c.ids_checked])
            for s, codes in checked.items():
                self.pending.put(s.slot, codes)
            return self._decode(streams, finish)

    def step(self, streams: Sequence[StreamSlot], codes: Sequence[Tensor]) -> list[Tensor]:
        """The batched form of :meth:`advance` for servers whose model emits the codes of many
        streams at once: k >= 1 new frames for each of ``streams`` (distinct, open), codes per level
        an integer tensor [len(streams), k * vq_strides[0] / vq_strides[i]] (row j: streams[j]),
        any device. Returns each stream's new final audio (1-D, same order)."""
        streams = tuple(streams)
        if not streams:
            raise ValueError("step needs at least one stream")
        if self.approximate_lookahead is not None:
            with self._lock:
                return self.emission.emit(list(streams), self._step(streams, codes), set())
        return self._step(streams, codes)

    def _step(self, streams: tuple, codes: Sequence[Tensor]) -> list[Tensor]:
        self.checks.check_step_shapes(codes, len(streams))
        arrays = [host_numpy(c) for c in codes]  # [B, L_i], any integer dtype
        frames = arrays[0].shape[1] // self.ratios[0]
        with self._lock:
            batch = self._step_batch(streams)
            slots = batch.slots
            if batch.started and self.schedule.steady(len(streams), slots, frames):
                return list(self.schedule.direct(slots, arrays, frames, keys=batch.keys).unbind(0))
            self.checks.check_ids([arrays])
            self.pending.put_rows(slots, arrays, frames)
            audio = self._decode(list(streams), [])
        return [audio[s] for s in streams]

    def step_rows(self, streams: Sequence[StreamSlot], rows: np.ndarray, frames: int) -> tuple[Tensor, np.ndarray]:
        """The serving path's step, for codes checked already (:meth:`check_codes`, or a
        :class:`~snac_fast.orpheus.TokenFramer`): ``frames`` new frames for each of ``streams``
        (distinct, open), as level-major rows int64 [len(streams), frames * codes per frame] (level 0
        of every frame, then level 1, ...: :meth:`row_of`). Returns the batch's new audio in one
        buffer: (audio 1-D in the engine's dtype on its device, offsets int64 [len(streams) + 1]);
        stream j's audio is ``audio[offsets[j]:offsets[j + 1]]``."""
        if self.approximate_lookahead is not None:
            with self._lock:
                audio, offsets = self._step_rows(streams, rows, frames)
                exact = [audio[offsets[j]:offsets[j + 1]] for j in range(len(streams))]
                return joined_audio(self.emission.emit(list(streams), exact, set()))
        return self._step_rows(streams, rows, frames)

    def _step_rows(self, streams: Sequence[StreamSlot], rows: np.ndarray, frames: int) -> tuple[Tensor, np.ndarray]:
        n = len(streams)
        levels, start = [], 0
        for r in self.ratios:
            levels.append(rows[:, start:start + frames * r])
            start += frames * r
        if rows.shape != (n, start):
            raise ValueError(f"rows {rows.shape} for {n} streams of {frames} frames: expected {(n, start)}")
        with self._lock:
            started = self._check_streams(list(streams))
            slots = slots_of(streams)
            if len(set(slots.tolist())) != n:
                raise ValueError("step_rows got the same stream twice")
            if started and self.schedule.steady(n, slots, frames):
                audio = self.schedule.direct(slots, levels, frames, ids_checked=True)
                return audio.reshape(-1), np.arange(n + 1, dtype=np.int64) * audio.shape[1]
            self.pending.put_rows(slots, levels, frames)
            pieces = self._decode(list(streams), [])
        return joined_audio([pieces[s] for s in streams])

    def frames_decoded(self, slot: int) -> int:
        """Frames the stream in state row ``slot`` has decoded (prefill and steps)."""
        return int(self.slots.consumed[slot])

    def frames_pending(self, slot: int) -> int:
        """Frames pushed to the stream in ``slot`` and not decoded yet."""
        return self.pending.held(slot)

    def check_codes(self, codes: Sequence[Tensor]) -> CheckedCodes:
        """One stream's codes for k >= 1 new frames, checked on the host before any kernel runs
        (:meth:`CodeChecker.check_codes`); :meth:`advance` takes them unchecked."""
        return self.checks.check_codes(codes)

    def row_of(self, codes: CheckedCodes) -> np.ndarray:
        """One stream's checked codes as the level-major row :meth:`step_rows` takes."""
        return np.concatenate(codes)

    def _step_batch(self, streams: tuple) -> "_StepBatch":
        """``step``'s streams, checked (ValueError for one closed, another engine's or repeated):
        their slots and key rows. Kept once all have started, until a stream closes: a server
        steps the same streams call after call, and checking them costs host time each call."""
        try:
            batch = self._step_batches.get(streams)
        except TypeError:  # an unhashable entry: _check_streams names it
            batch = None
        if batch is not None:
            return batch
        started = self._check_streams(list(streams))
        slots = slots_of(streams)
        if len(set(slots.tolist())) != len(streams):
            raise ValueError("step got the same stream twice")
        keys = self.slots.keys_of(slots, self.steps.bucket(len(slots)))
        batch = _StepBatch(slots, keys, started)
        if started:
            if len(self._step_batches) >= 64:
                self._step_batches.clear()
            self._step_batches[streams] = batch
        return batch

    def _decode(self, pushed: list[StreamSlot], finish: list[StreamSlot]) -> dict[StreamSlot, Tensor]:
        """Decode what ``pushed`` streams hold and end ``finish`` (:meth:`Schedule.decode`); under the lock."""
        out = self.schedule.decode(pushed, finish)
        for s in finish:
            self.close(s)
        return out

    def _check_streams(self, streams: list[StreamSlot]) -> bool:
        """ValueError for a stream that is closed or not this engine's; returns whether all have started."""
        started = True
        for s in streams:
            if not isinstance(s, StreamSlot) or s.engine is not self or s.closed:
                raise ValueError("that stream is closed (finished or released) or belongs to another engine; "
                                 "open a new one")
            started = started and s.started
        return started

    def empty_audio(self) -> Tensor:
        return self.schedule.empty_audio()
