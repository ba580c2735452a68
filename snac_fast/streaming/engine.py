"""The batched stream engine: state rows for many streams, prefill / step / flush runs, CUDA graphs.

:class:`StreamEngine` is the engine's state and scheduling; its other parts live beside it, each a
mixin of one concern: :mod:`.lookahead` (facts of time, approximate emission), :mod:`.code_checks`
(its inputs' checks), :mod:`.step_shapes` (step sizes and the warm-up), :mod:`.stage_forward` (the
step through the stages, what a CUDA graph captures)."""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from snac_fast.model.noise import check_seed
from snac_fast.ops.device import device_scope
from snac_fast.runtime.graphs import out_of_memory_explained
from snac_fast.streaming.code_checks import CodeChecker, host_numpy
from snac_fast.streaming.geometry import Geometry, align_contexts, build_stages
from snac_fast.streaming.layer_state import LayerStates
from snac_fast.streaming.lookahead import LookaheadGeometry, preset_lookahead
from snac_fast.streaming.pending import CheckedCodes, PendingCodes
from snac_fast.streaming.shapes import (
    CODELESS,
    FLUSH,
    PREFILL,
    STEP,
    bucket_rows,
    joined_audio,
    slots_of,
)
from snac_fast.streaming.stage_forward import StageForward
from snac_fast.streaming.step_graph import StepGraph
from snac_fast.streaming.step_shapes import StepShapes


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
    step's key rows (int64 [4, bucket], :meth:`StreamEngine._write_keys`) and whether all have started."""

    slots: np.ndarray
    keys: np.ndarray
    started: bool


class StreamEngine(LookaheadGeometry, StepShapes):
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
    """

    def __init__(self, model: nn.Module, config: dict, max_streams: int = 256, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, lookahead: int | str | None = None, cuda_graphs: bool = False,
                 max_frames_per_step: int = 8, max_graphs: int = 64, layered: bool | None = None, compile: bool = False,
                 lock=None) -> None:
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
        self._tail_keep = self._tail_lengths(window) if self.approximate_lookahead is not None else None
        self.max_streams = max_streams
        self.max_frames_per_step = max(self.geometry.group, max_frames_per_step // self.geometry.group * self.geometry.group)
        if layered is None:  # a CPU's exact float32 streams: state per layer computes no context twice
            # (in bfloat16 its torch ops round every layer: 18 dB against float32 where the stages' give 26)
            layered = (self.device.type == "cpu" and self.approximate_lookahead is None
                       and dtype in (torch.float32, torch.float64))
        if layered and (self.approximate_lookahead is not None or cuda_graphs):
            raise ValueError("layered=True is for exact streams without CUDA graphs")
        if compile and not layered:
            raise ValueError("compile=True compiles the per-layer step of a CPU's exact streams (layered)")
        # row max_streams: scratch for the padding rows of a bucket
        self._layered = LayerStates(model, max_streams + 1, exact.lookahead_samples, self.strides[0],
                                    device=self.device, dtype=dtype, compile=compile) if layered else None
        if self._layered is not None:
            self.state = self._layered.states
        else:
            with torch.inference_mode(False):
                self.state = [torch.zeros((max_streams + 1, s.channels, s.context), device=self.device, dtype=self.dtype)
                              for s in self.geometry.stages]
        # the step itself (what the step graphs capture), a part that owns its launch choices
        self.forward = StageForward(model, self.geometry, self.state, self._layered, self._tail_keep)
        self._free = list(range(max_streams - 1, -1, -1))
        self._pending = PendingCodes(max_streams, self.ratios)
        # per slot, the key rows of a step (frames consumed, seed, row): one gather for all three
        self._slot_keys = np.zeros((3, max_streams + 1), np.int64)
        self._consumed, self._seeds, self._rows = self._slot_keys
        # approximate streams, per slot: exact audio produced so far, and audio emitted (samples)
        self._exact_out = np.zeros(max_streams + 1, np.int64)
        self._emitted = np.zeros(max_streams + 1, np.int64)
        self._step_batches: dict[tuple, _StepBatch] = {}  # step's streams -> their slots and keys
        self._lock = lock or threading.RLock()  # a codec's: its decodes patch the same NoiseBlocks
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs a CUDA device")
        self.cuda_graphs = cuda_graphs
        self.max_graphs = max_graphs
        self._graphs: dict[tuple, StepGraph] = {}
        # after a warm-up: the step shapes (STEP, bucket, frames) warmed. A step of more frames than
        # a warmed one then runs as one-group steps: capturing its graph mid-serving held the first
        # audio of a server's first streams for 85-250 ms (docs/http_server.md)
        self._warmed_steps: set[tuple] | None = None
        # one memory pool for every step graph (they replay one at a time), which the warm-up's eager
        # passes use too; reserved as one segment before the first (StepShapes._reserve_pool)
        self._pool = torch.cuda.MemPool() if cuda_graphs else None
        self._pool_reserved = False
        self._graph_streams: tuple | None = None  # (capture, side), made at the first capture

    # -- streams -------------------------------------------------------------------------------

    def open(self, seed: int | None = None, row: int = 0) -> StreamSlot:
        """A new stream. seed: its noise key (None: a random one; fresh noise like an unseeded
        decode); its audio equals row ``row`` of ``decode(codes, seed=seed)``."""
        seed = secrets.randbits(63) if seed is None else check_seed(seed)
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < 1 << 31:
            raise ValueError(f"row must be an int in [0, 2**31), got {row!r}")
        with self._lock:
            if not self._free:
                raise RuntimeError(f"all {self.max_streams} stream slots are in use: finish or close streams, or "
                                   "make an engine with a larger max_streams")
            slot = self._free.pop()
            self._pending.clear(slot)
            self._consumed[slot], self._seeds[slot], self._rows[slot] = 0, seed, row
            self._exact_out[slot] = self._emitted[slot] = 0
            return StreamSlot(self, slot, seed, row)

    def close(self, stream: StreamSlot) -> None:
        """Release a stream's slot without decoding what it still holds."""
        with self._lock:
            if not stream.closed:
                stream.closed = True
                self._step_batches.clear()
                self._pending.clear(stream.slot)
                self._free.append(stream.slot)

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
            return dict(zip(exact, self._emit(list(exact), list(exact.values()), set(finish))))

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
                    and self._in_steady_state(len(streams), slots, codes[0].frames)):
                arrays = [level[None] for level in codes[0]] if len(codes) == 1 else [np.stack(c) for c in zip(*codes)]
                ids_checked = all(c.ids_checked for c in codes)  # check_codes' output: checked once already
                return dict(zip(streams, self._direct_step(slots, arrays, codes[0].frames, ids_checked).unbind(0)))
            self.checks.check_ids([c for c in codes if not c.ids_checked])
            for s, codes in checked.items():
                self._pending.put(s.slot, codes)
            return self._decode_pending(streams, finish)

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
                return self._emit(list(streams), self._step(streams, codes), set())
        return self._step(streams, codes)

    def _step(self, streams: tuple, codes: Sequence[Tensor]) -> list[Tensor]:
        self.checks.check_step_shapes(codes, len(streams))
        arrays = [host_numpy(c) for c in codes]  # [B, L_i], any integer dtype
        frames = arrays[0].shape[1] // self.ratios[0]
        with self._lock:
            batch = self._step_batch(streams)
            slots = batch.slots
            if batch.started and self._in_steady_state(len(streams), slots, frames):
                return list(self._direct_step(slots, arrays, frames, keys=batch.keys).unbind(0))
            self.checks.check_ids([arrays])
            self._pending.put_rows(slots, arrays, frames)
            audio = self._decode_pending(list(streams), [])
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
                return joined_audio(self._emit(list(streams), exact, set()))
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
            if started and self._in_steady_state(n, slots, frames):
                audio = self._direct_step(slots, levels, frames, ids_checked=True)
                return audio.reshape(-1), np.arange(n + 1, dtype=np.int64) * audio.shape[1]
            self._pending.put_rows(slots, levels, frames)
            pieces = self._decode_pending(list(streams), [])
        return joined_audio([pieces[s] for s in streams])

    def frames_decoded(self, slot: int) -> int:
        """Frames the stream in state row ``slot`` has decoded (prefill and steps)."""
        return int(self._consumed[slot])

    def frames_pending(self, slot: int) -> int:
        """Frames pushed to the stream in ``slot`` and not decoded yet."""
        return self._pending.held(slot)

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
        keys = np.empty((4, self._bucket(len(slots))), np.int64)
        self._write_keys(keys, slots)
        batch = _StepBatch(slots, keys, started)
        if started:
            if len(self._step_batches) >= 64:
                self._step_batches.clear()
            self._step_batches[streams] = batch
        return batch

    def _in_steady_state(self, streams: int, slots: np.ndarray, frames: int) -> bool:
        """A server's steady state, under the lock, for ``streams`` started streams (``slots``):
        none holding pending frames, and ``frames`` one step's worth for one batch."""
        return (streams <= self.max_streams and self._step_frames(frames) == frames
                and self._runnable_frames(streams, frames) == frames
                and (self._pending.frames_held == 0 or not (self._pending.tail[slots] != self._pending.head[slots]).any()))

    def _direct_step(self, slots: np.ndarray, codes: list[np.ndarray], frames: int,
                     ids_checked: bool = False, keys: np.ndarray | None = None) -> list[Tensor]:
        """In the steady state, the codes (per level [len(slots), L_i], any integer dtype) go
        straight into one batched step, without the pending buffers; returns the audio [n, samples].
        With a captured graph the codes and keys are written into its pinned inputs and the ids
        checked there (one reduction), before any state changes. ``keys``: the batch's key rows
        (:meth:`_write_keys` of ``slots``), all but the frames consumed, which change every step."""
        n, bucket = len(slots), self._bucket(len(slots))
        graph = self._graphs.get((STEP, bucket, frames)) if self.cuda_graphs else None
        if graph is None:
            if not ids_checked:
                self.checks.check_ids([codes])
            codes = [c.astype(np.int64, copy=False) for c in codes]
            with torch.inference_mode(), device_scope(self.device):
                return self._run(STEP, slots, frames, codes)
        graph_keys, *levels = graph.inputs()
        if keys is None:
            self._write_keys(graph_keys, slots)
        else:
            graph_keys[...] = keys
            np.take(self._consumed, slots, out=graph_keys[1, :n])
        for level, c in zip(levels, codes):
            level[:n] = c
            if n < bucket:  # padding rows: code 0
                level[n:] = 0
        if not ids_checked and graph.unsigned_codes.max() >= self.codebook_size:  # negatives wrap high
            self.checks.check_ids([codes])  # names the level and the id
            raise ValueError(f"codes hold ids outside [0, {self.codebook_size})")
        with device_scope(self.device):
            audio = graph.launch()[:n, 0].clone()  # the next replay overwrites the graph's output
        self._consumed[slots] += frames  # after the launch: host work the GPU's step hides
        return audio

    def _check_streams(self, streams: list[StreamSlot]) -> bool:
        """ValueError for a stream that is closed or not this engine's; returns whether all have started."""
        started = True
        for s in streams:
            if not isinstance(s, StreamSlot) or s.engine is not self or s.closed:
                raise ValueError("that stream is closed (finished or released) or belongs to another engine; "
                                 "open a new one")
            started = started and s.started
        return started

    def _decode_pending(self, pushed: list[StreamSlot], finish: list[StreamSlot]) -> dict[StreamSlot, Tensor]:
        """Decode what ``pushed`` streams hold (prefills, steps) and end ``finish``; under the lock."""
        pieces: dict[StreamSlot, list[Tensor]] = {s: [] for s in pushed + finish}
        with torch.inference_mode(), device_scope(self.device):
            self._run_prefills([s for s in pieces if not s.started and s.pending_frames >= self.prefill_frames], pieces)
            self._run_steps([s for s in pieces if s.started], pieces)
            self._run_finishes(finish, pieces)
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

    def empty_audio(self) -> Tensor:
        return torch.empty(0, device=self.device, dtype=self.dtype)

    # -- scheduling ----------------------------------------------------------------------------

    def _run_prefills(self, streams: list[StreamSlot], pieces) -> None:
        for chunk in self._chunks(streams):
            audio = self._run(PREFILL, slots_of(chunk), self.prefill_frames).unbind(0)
            for s, a in zip(chunk, audio):
                s.started = True
                pieces[s].append(a)

    def _run_steps(self, streams: list[StreamSlot], pieces) -> None:
        while streams:
            slots = slots_of(streams)
            frames = self._step_frames_of(self._pending.tail[slots] - self._pending.head[slots])
            # the distinct step sizes, without np.unique: its first call imports numpy.ma (a stall,
            # seen as the first prefills' slow pushes under load; docs/measurements.md)
            for k in sorted(set(frames[frames > 0].tolist())):
                picked = np.flatnonzero(frames == k)
                group = streams if len(picked) == len(streams) else [streams[i] for i in picked]
                for chunk in self._chunks(group):
                    step = self._runnable_frames(len(chunk), k)
                    for s, a in zip(chunk, self._run(STEP, slots_of(chunk), step).unbind(0)):
                        pieces[s].append(a)
            # streams that pushed more than one step's frames go round again
            more = (frames > 0) & (self._pending.tail[slots] - self._pending.head[slots] >= self.frames_per_group)
            streams = [streams[i] for i in np.flatnonzero(more)]

    def _run_finishes(self, streams: list[StreamSlot], pieces) -> None:
        started = [s for s in streams if s.started]
        for chunk in self._chunks(started):
            for s, a in zip(chunk, self._run(FLUSH, slots_of(chunk), 0).unbind(0)):
                pieces[s].append(a)
        for s in streams:
            if not s.started and s.pending_frames:  # shorter than a prefill: decode it whole
                pieces[s].append(self._decode_whole(s))
        for s in streams:
            self.close(s)

    def _chunks(self, streams: list[StreamSlot]) -> Iterable[list[StreamSlot]]:
        step = self.max_streams
        return (streams[i:i + step] for i in range(0, len(streams), step))

    def _decode_whole(self, s: StreamSlot, take: bool = True) -> Tensor:
        """The whole decode of the codes ``s`` holds (taking them, unless not ``take``): [samples]."""
        from snac_fast.model.noise import keyed_noise

        held = self._pending.take_all(s.slot) if take else self._pending.peek_all(s.slot)
        codes = [torch.from_numpy(c)[None].to(self.device) for c in held]
        seeds = torch.tensor([s.seed], dtype=torch.int64, device=self.device)
        rows = torch.tensor([s.row], dtype=torch.int64, device=self.device)
        with keyed_noise(self.model, seeds, rows):
            return self.model.decode(codes)[0, 0]

    # -- one batched call ----------------------------------------------------------------------

    def _bucket(self, n: int) -> int:
        """Rows of the batch that runs n streams: :func:`bucket_rows` (at most max_streams) under CUDA graphs."""
        return min(bucket_rows(n), self.max_streams) if self.cuda_graphs else n

    def _write_keys(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Fill a step's keys, int64 [4, bucket]: per row the state slot, frames consumed, seed and
        noise row of ``slots``; the padding rows past len(slots) get the scratch slot and zeros."""
        n = len(slots)
        keys[0, :n] = slots
        keys[1:, :n] = self._slot_keys[:, slots]
        if n < keys.shape[1]:
            keys[0, n:], keys[1:, n:] = self.max_streams, 0

    def _run(self, kind: str, slots: np.ndarray, frames: int, codes: list[np.ndarray] | None = None) -> Tensor:
        """Run one kind of step for the streams of state ``slots``, each taking its next ``frames``
        pending frames (none for a flush), or ``codes`` (per level int64 [len(slots), L_i]) when
        given instead; returns the streams' new audio, [len(slots), samples] (row j: slots[j])."""
        n = len(slots)
        bucket = self._bucket(n)
        keys = np.empty((4, bucket), np.int64)
        self._write_keys(keys, slots)
        if kind not in CODELESS:
            codes = self._pending.take(slots, frames) if codes is None else codes  # n rows
            self._consumed[slots] += frames
        else:
            codes = []
        if self.cuda_graphs:
            key = (kind, bucket, frames)
            graph = self._graphs.get(key)
            if graph is None:
                if len(self._graphs) >= self.max_graphs:
                    self._graphs.pop(next(iter(self._graphs)))
                padded = [np.pad(level, ((0, bucket - n), (0, 0))) for level in codes]  # the graph's shapes
                with out_of_memory_explained(f"capturing a stream step's CUDA graph ({kind}, {bucket} rows)"):
                    graph = self._graphs[key] = self._step_graph(kind, keys, padded, frames)
            # rows past n keep earlier calls' codes: valid codes, decoded into the scratch slot
            return graph(keys, codes)[:n, 0].clone()  # the next replay overwrites the graph's output
        return self.forward(kind, torch.from_numpy(keys).to(self.device),
                             [torch.from_numpy(c).to(self.device) for c in codes], frames)[:n, 0]
