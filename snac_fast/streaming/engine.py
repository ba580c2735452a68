"""The batched stream engine: state rows for many streams, prefill / step / flush runs, CUDA graphs."""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from snac_fast.compiling import compiling_concurrently
from snac_fast.graphs import out_of_memory_explained
from snac_fast.noise import check_seed, patched_noise
from snac_fast.ops._runtime import device_scope, launches_as_recorded, tiles_as_for_fewer_rows
from snac_fast.ops.context import context_step
from snac_fast.ops.noise import keyed_normal
from snac_fast.streaming.geometry import Geometry, _align_contexts, build_stages
from snac_fast.streaming.pending import CheckedCodes, _PendingCodes
from snac_fast.streaming.step_graph import NoiseCall, StepGraph

PREFILL, STEP, FLUSH = "prefill", "step", "flush"
TAIL = "tail"  # an approximate stream's flush, cut to the audio its emission needs
_CODELESS = (FLUSH, TAIL)  # the kinds that take no new codes
# steps of up to this many rows take the 1-row step's tiles: warming 256 streams compiles 153 kernels
# instead of 207 (cold start 16.3 -> 13.3 s on an H100) for 8-30% more GPU time at 2-8 rows
# (0.05-0.1 ms a step; docs/serving.md)
ONE_ROW_TILES_UP_TO = 8
_INTEGER_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


def bucket_rows(n: int) -> int:
    """Rows of the step graph that runs ``n`` streams: the next power of two up to 32, then the
    next of 2^k and 1.5 * 2^k (48, 64, 96, 128, 192, ...). A step's GPU time grows about linearly
    past ~64 rows, so a call of 65 streams padded to 128 rows spent half its time on padding."""
    top = 1 << (n - 1).bit_length()
    return top if top <= 32 or n > 3 * top // 4 else 3 * top // 4


def warmup_buckets(max_batch: int) -> list[int]:
    """The step-graph rows of every batch of 1 to ``max_batch`` streams (what a warm-up captures)."""
    sizes = [1 << i for i in range(max_batch.bit_length() + 1)] + [3 << i for i in range(max_batch.bit_length())]
    return sorted({bucket_rows(min(size, max_batch)) for size in sizes})


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
        return int(self.engine._consumed[self.slot])

    @property
    def pending_frames(self) -> int:
        """Frames pushed but not decoded yet."""
        return self.engine._pending.held(self.slot)


@dataclass
class _StepBatch:
    """The streams of one :meth:`StreamEngine.step` call: their state ``slots`` (int64 [n]), the
    step's key rows (int64 [4, bucket], :meth:`StreamEngine._write_keys`) and whether all have started."""

    slots: np.ndarray
    keys: np.ndarray
    started: bool


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
    """

    def __init__(self, model: nn.Module, config: dict, max_streams: int = 256, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, lookahead: int | str | None = None, cuda_graphs: bool = False,
                 max_frames_per_step: int = 8, max_graphs: int = 64, lock=None) -> None:
        if max_streams < 1:
            raise ValueError("max_streams must be at least 1")
        self.model, self.config = model, config
        self.device, self.dtype = torch.device(device), dtype
        self.strides = list(config["vq_strides"])
        self.codebook_size = int(config["codebook_size"])
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
        _align_contexts(stages, exact)  # its a and group: neither depends on the contexts
        self.geometry = Geometry.of(stages, self.strides[0], window)
        self._tail_keep = self._tail_lengths(window) if self.approximate_lookahead is not None else None
        self.max_streams = max_streams
        self.max_frames_per_step = max(self.geometry.group, max_frames_per_step // self.geometry.group * self.geometry.group)
        with torch.inference_mode(False):  # row max_streams: scratch for the padding rows of a bucket
            self.state = [torch.zeros((max_streams + 1, s.channels, s.context), device=self.device, dtype=self.dtype)
                          for s in self.geometry.stages]
        self._free = list(range(max_streams - 1, -1, -1))
        self._ratios = [self.strides[0] // s for s in self.strides]
        self._pending = _PendingCodes(max_streams, self._ratios)
        # per slot, the key rows of a step (frames consumed, seed, row): one gather for all three
        self._slot_keys = np.zeros((3, max_streams + 1), np.int64)
        self._consumed, self._seeds, self._rows = self._slot_keys
        # approximate streams, per slot: exact audio produced so far, and audio emitted (samples)
        self._exact_out = np.zeros(max_streams + 1, np.int64)
        self._emitted = np.zeros(max_streams + 1, np.int64)
        self._step_config = {**config, "attn_window_size": None}  # step takes any frame count; groups are the engine's
        self._step_signatures: set[tuple] = set()  # (type, dtype, shape) per level of step's codes, validated
        self._step_batches: dict[tuple, _StepBatch] = {}  # step's streams -> their slots and keys
        self._lock = lock or threading.RLock()  # a codec's: its decodes patch the same NoiseBlocks
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs a CUDA device")
        self.cuda_graphs = cuda_graphs
        self.max_graphs = max_graphs
        self._graphs: dict[tuple, StepGraph] = {}
        # per batch bucket, the one-frame step's launch choices, which that bucket's prefills and
        # flushes reuse (ops._runtime.launches_as_recorded): no kernel variants of their own to compile
        self._launches: dict[int, dict] = {}
        # after a warm-up: the step shapes (STEP, bucket, frames) warmed. A step of more frames than
        # a warmed one then runs as one-group steps: capturing its graph mid-serving held the first
        # audio of a server's first streams for 85-250 ms (H200, docs/serving.md)
        self._warmed_steps: set[tuple] | None = None
        self._pool = torch.cuda.graph_pool_handle() if cuda_graphs else None  # graphs replay one at a time

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

    # -- facts ---------------------------------------------------------------------------------

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

    def warmup(self, max_batch: int | None = None, frames: Sequence[int] = (), compiled: bool = False) -> int:
        """Capture the CUDA graphs (and compile the kernels) of every step a server will run, so
        that no stream pays for them later: prefill, one-group step and flush at every batch bucket
        up to ``max_batch`` (default max_streams), plus steps of the given ``frames`` counts. Runs on
        the scratch state row; open streams are untouched. From then on a stream holding more frames
        than a warmed step takes runs several one-group steps (the same audio) rather than wait for
        a new graph. ``compiled``: :meth:`compile_steps` ran already for these shapes. Returns the
        number of graphs captured (0 without CUDA graphs)."""
        if not self.cuda_graphs:
            return 0
        shapes = self._warmup_shapes(max_batch, frames)
        inputs = self._warmup_inputs(shapes)
        with self._lock, torch.inference_mode(), device_scope(self.device):
            if not compiled:
                self._launch_shapes(inputs)
            for shape, (keys, codes) in inputs.items():
                graph = self._graphs[shape] = self._step_graph(shape[0], keys, codes, shape[2], compiled=True)
                graph(keys, codes)  # a first replay uploads the graph: the first stream's step does not wait for it
            # the first launches of what a batch of mixed prefills and steps adds (lazily loaded kernels)
            joined_audio([self.empty_audio(), torch.zeros(3, device=self.device, dtype=self.dtype)])
        torch.cuda.synchronize(self.device)
        self._warmed_steps = (self._warmed_steps or set()) | {shape for shape in shapes if shape[0] == STEP}
        return len(inputs)

    def compile_steps(self, max_batch: int | None = None, frames: Sequence[int] = ()) -> None:
        """Compile the kernels of the steps :meth:`warmup` captures for these arguments, without
        capturing: one shapes-only pass in which every kernel compiles concurrently. Inside a caller's
        :func:`~snac_fast.compiling.compiling_concurrently` block they join that block's compiles
        (:func:`snac_fast.warmup.warmup` compiles the decode shapes and the steps in one pass)."""
        if not self.cuda_graphs:
            return
        inputs = self._warmup_inputs(self._warmup_shapes(max_batch, frames))
        with self._lock, torch.inference_mode(), device_scope(self.device):
            self._launch_shapes(inputs)

    def _warmup_shapes(self, max_batch: int | None, frames: Sequence[int]) -> list[tuple[str, int, int]]:
        top = min(max_batch or self.max_streams, self.max_streams)
        buckets = sorted({self._bucket(b) for b in warmup_buckets(top)})
        more = sorted({self._step_frames(int(k)) for k in frames} - {0, self.frames_per_group})
        # each bucket's one-frame step first: it records the launches the others reuse
        shapes = [(kind, b, k) for b in buckets for kind, k in
                  [(STEP, k) for k in [self.frames_per_group, *more]] + [(PREFILL, self.prefill_frames), (FLUSH, 0)]
                  + ([(TAIL, 0)] if self.approximate_lookahead is not None else [])]
        if len(shapes) > self.max_graphs:
            raise ValueError(f"warmup needs {len(shapes)} graphs but the engine keeps {self.max_graphs}: "
                             "raise max_graphs or warm fewer shapes")
        return shapes

    def _warmup_inputs(self, shapes: list[tuple[str, int, int]]) -> dict:
        """Scratch-row keys and zero codes for each shape not captured yet."""
        inputs = {}
        for kind, bucket, k in shapes:
            if (kind, bucket, k) in self._graphs:
                continue
            keys = np.zeros((4, bucket), np.int64)
            keys[0] = self.max_streams  # the scratch row
            inputs[kind, bucket, k] = keys, [] if kind in _CODELESS else [np.zeros((bucket, k * r), np.int64) for r in self._ratios]
        return inputs

    def _launch_shapes(self, inputs: dict) -> None:
        """One shapes-only pass over every step first: all their kernels compile at once, instead of
        each graph's compiling while the others wait (an empty Triton cache)."""
        with compiling_concurrently():
            for (kind, bucket, k), (keys, codes) in inputs.items():
                self._forward(kind, torch.from_numpy(keys).to(self.device),
                              [torch.from_numpy(c).to(self.device) for c in codes], k)

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

    def check_codes(self, codes: Sequence[Tensor]) -> CheckedCodes:
        """One stream's codes for k >= 1 new frames: per level [L_i] or [1, L_i] integers (any
        device) with L_i = k * vq_strides[0] / vq_strides[i], ids in [0, codebook_size). Returns
        them as int64 numpy [L_i] (:class:`CheckedCodes`, which :meth:`advance` takes unchecked)."""
        checked = self._check_shapes(codes)
        if not checked.ids_checked:
            self._check_ids([checked])
            checked.ids_checked = True
        return checked

    def _check_shapes(self, codes: Sequence[Tensor]) -> CheckedCodes:
        if isinstance(codes, CheckedCodes):
            return codes
        n = len(self.strides)
        if not isinstance(codes, (list, tuple)) or not all(isinstance(c, Tensor) for c in codes):
            raise ValueError(f"codes must be a list of {n} tensors, one per level")
        if len(codes) != n:
            raise ValueError(f"this model has {n} code levels (vq_strides {self.strides}), got {len(codes)}")
        checked = CheckedCodes()
        for i, c in enumerate(codes):
            if c.dtype not in _INTEGER_DTYPES:
                raise ValueError(f"codes level {i} must be an integer tensor, got {c.dtype}")
            a = _int64_numpy(c)
            if a.ndim == 2 and a.shape[0] == 1:
                a = a[0]
            if a.ndim != 1:
                raise ValueError(f"codes level {i} must be [L] or [1, L] for one stream, got {tuple(c.shape)}")
            checked.append(a)
        frames = len(checked[0])
        want = [frames * r for r in self._ratios]
        if frames == 0 or [len(c) for c in checked] != want:
            raise ValueError(f"code lengths {[len(c) for c in checked]} do not follow vq_strides {self.strides}: "
                             f"for {max(frames, 1)} frames expect {[max(frames, 1) * r for r in self._ratios]}")
        checked.frames = frames
        return checked

    def _check_ids(self, streams: list[CheckedCodes]) -> None:
        """Every id of every stream in [0, codebook_size): one numpy pass over all of them."""
        if not streams:
            return
        flat = np.concatenate([c.ravel() for codes in streams for c in codes])
        if flat.min() >= 0 and flat.max() < self.codebook_size:
            return
        for codes in streams:
            for i, c in enumerate(codes):
                bad = c[(c < 0) | (c >= self.codebook_size)]
                if bad.size:
                    raise ValueError(f"codes level {i} holds id {bad[0]}, outside [0, {self.codebook_size}) "
                                     "of this model's codebook")

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
        checked = {s: self._check_shapes(c) for s, c in pushes.items()}
        with self._lock:
            all_started = self._check_streams(list(checked) + finish)
            for s in finish:
                held = s.pending_frames + (checked[s].frames if s in checked else 0)
                if held % self.frames_per_group:
                    raise ValueError(f"a stream of this model must end on a multiple of {self.frames_per_group} frames "
                                     f"(its attention windows); this one ends with {s.frames + held}")
            streams = list(checked)
            codes = list(checked.values())
            slots = _slots_of(streams)
            if (all_started and not finish and len({c.frames for c in codes}) == 1
                    and self._in_steady_state(len(streams), slots, codes[0].frames)):
                arrays = [level[None] for level in codes[0]] if len(codes) == 1 else [np.stack(c) for c in zip(*codes)]
                ids_checked = all(c.ids_checked for c in codes)  # check_codes' output: checked once already
                return dict(zip(streams, self._direct_step(slots, arrays, codes[0].frames, ids_checked).unbind(0)))
            self._check_ids([c for c in codes if not c.ids_checked])
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
        self._check_step_shapes(codes, len(streams))
        arrays = [_host_numpy(c) for c in codes]  # [B, L_i], any integer dtype
        frames = arrays[0].shape[1] // self._ratios[0]
        with self._lock:
            batch = self._step_batch(streams)
            slots = batch.slots
            if batch.started and self._in_steady_state(len(streams), slots, frames):
                return list(self._direct_step(slots, arrays, frames, keys=batch.keys).unbind(0))
            self._check_ids([arrays])
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
        for r in self._ratios:
            levels.append(rows[:, start:start + frames * r])
            start += frames * r
        if rows.shape != (n, start):
            raise ValueError(f"rows {rows.shape} for {n} streams of {frames} frames: expected {(n, start)}")
        with self._lock:
            started = self._check_streams(list(streams))
            slots = _slots_of(streams)
            if len(set(slots.tolist())) != n:
                raise ValueError("step_rows got the same stream twice")
            if started and self._in_steady_state(n, slots, frames):
                audio = self._direct_step(slots, levels, frames, ids_checked=True)
                return audio.reshape(-1), np.arange(n + 1, dtype=np.int64) * audio.shape[1]
            self._pending.put_rows(slots, levels, frames)
            pieces = self._decode_pending(list(streams), [])
        return joined_audio([pieces[s] for s in streams])

    def _emit(self, streams: list[StreamSlot], exact: list[Tensor], finishing: set) -> list[Tensor]:
        """Approximate streams, under the lock, after an exact call: each stream's exact new audio
        (``exact[j]``, continuing its earlier exact audio) -> the audio it emits now. A stream's
        output runs to L samples before its newest decoded frame, from the decode of all its codes
        as if it ended there: its exact audio, then a flush of a copy of its state (restored after);
        before its prefill, a whole decode of the codes it holds. A flush emits all that is left."""
        L, per_frame, group = self.approximate_lookahead, self.samples_per_frame, self.frames_per_group
        running = [s for s in streams if s not in finishing and s.started]
        tails: dict[StreamSlot, Tensor] = {}
        if running:
            slots = _slots_of(running)
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
        slots = _slots_of(streams)
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

    def _check_step_shapes(self, codes: Sequence[Tensor], rows: int) -> None:
        """:func:`validate_codes`' checks of ``step``'s codes (ids aside), run once per distinct
        (type, dtype, shape) of the levels: a server sends the same shapes every step."""
        signature = None
        if type(codes) in (list, tuple):
            try:
                signature = tuple((type(c), c.dtype, c.shape) for c in codes)
            except AttributeError:
                pass
        if signature is None or signature not in self._step_signatures:
            from snac_fast.codes import validate_codes

            validate_codes(codes, self._step_config, check_ids=False)  # [B, L_i] following vq_strides
            if signature is not None and len(self._step_signatures) < 64:
                self._step_signatures.add(signature)
        if codes[0].shape[0] != rows:
            raise ValueError(f"codes hold {codes[0].shape[0]} rows for {rows} streams")

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
                self._check_ids([codes])
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
            self._check_ids([codes])  # names the level and the id
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
            audio = self._run(PREFILL, _slots_of(chunk), self.prefill_frames).unbind(0)
            for s, a in zip(chunk, audio):
                s.started = True
                pieces[s].append(a)

    def _step_frames(self, pending: int) -> int:
        """The largest step of a power-of-two number of groups that fits what a stream holds."""
        groups = min(int(pending), self.max_frames_per_step) // self.frames_per_group
        return (1 << groups.bit_length() - 1) * self.frames_per_group if groups > 0 else 0

    def _runnable_frames(self, streams: int, frames: int) -> int:
        """The frames a step of ``streams`` streams holding ``frames`` takes: all of them, unless a
        warm-up fixed the step shapes and theirs is not among them (then one group)."""
        if self._warmed_steps is None or frames == self.frames_per_group:
            return frames
        return frames if (STEP, self._bucket(streams), frames) in self._warmed_steps else self.frames_per_group

    def _step_frames_of(self, pending: np.ndarray) -> np.ndarray:
        """:meth:`_step_frames` of every entry of an int array (0 where not a group is held)."""
        groups = np.minimum(pending, self.max_frames_per_step) // self.frames_per_group
        bits = np.frexp(groups.astype(np.float64))[1]  # bit_length, exact for these small counts
        return np.where(groups > 0, np.left_shift(1, np.maximum(bits - 1, 0)) * self.frames_per_group, 0)

    def _run_steps(self, streams: list[StreamSlot], pieces) -> None:
        while streams:
            slots = _slots_of(streams)
            frames = self._step_frames_of(self._pending.tail[slots] - self._pending.head[slots])
            # the distinct step sizes, without np.unique: its first call imports numpy.ma (a stall,
            # seen as the first prefills' slow pushes under load; docs/measurements.md)
            for k in sorted(set(frames[frames > 0].tolist())):
                picked = np.flatnonzero(frames == k)
                group = streams if len(picked) == len(streams) else [streams[i] for i in picked]
                for chunk in self._chunks(group):
                    step = self._runnable_frames(len(chunk), k)
                    for s, a in zip(chunk, self._run(STEP, _slots_of(chunk), step).unbind(0)):
                        pieces[s].append(a)
            # streams that pushed more than one step's frames go round again
            more = (frames > 0) & (self._pending.tail[slots] - self._pending.head[slots] >= self.frames_per_group)
            streams = [streams[i] for i in np.flatnonzero(more)]

    def _run_finishes(self, streams: list[StreamSlot], pieces) -> None:
        started = [s for s in streams if s.started]
        for chunk in self._chunks(started):
            for s, a in zip(chunk, self._run(FLUSH, _slots_of(chunk), 0).unbind(0)):
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
        from snac_fast.noise import keyed_noise

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
        if kind not in _CODELESS:
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
        return self._forward(kind, torch.from_numpy(keys).to(self.device),
                             [torch.from_numpy(c).to(self.device) for c in codes], frames)[:n, 0]

    def _step_graph(self, kind: str, keys: np.ndarray, codes: list[np.ndarray], frames: int,
                    compiled: bool = False) -> StepGraph:
        return StepGraph(self._forward, self.draw_noise, self.state, self._pool, kind, keys, codes, frames, compiled)

    def _forward(self, kind: str, keys: Tensor, codes: list[Tensor], frames: int,
                 noise_for: Callable[[NoiseCall], Tensor] | None = None) -> Tensor:
        """The step itself, on device tensors only (what a CUDA graph captures). keys: int64
        [4, B] (state slot, frames consumed, seed, row); codes: per level [B, L_i] (not for flush).
        noise_for: where NoiseBlocks get their noise (default: :meth:`draw_noise`)."""
        rows = keys.shape[1]
        recording = kind == STEP and frames == self.frames_per_group
        with tiles_as_for_fewer_rows(rows if rows <= ONE_ROW_TILES_UP_TO else 1), \
                launches_as_recorded(self._launches.setdefault(rows, {}), recording):
            return self._forward_rows(kind, keys, codes, frames, noise_for)

    def _forward_rows(self, kind: str, keys: Tensor, codes: list[Tensor], frames: int,
                      noise_for: Callable[[NoiseCall], Tensor] | None) -> Tensor:
        geo = self.geometry
        slots = keys[0]
        new = self.model.quantizer.from_codes(codes) if kind not in _CODELESS else None
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
                    x = x[:, :, :self._tail_keep[l]]
                for layer in stage.post:
                    x = layer(x.contiguous())
                new = x
        return new

    @staticmethod
    def draw_noise(keys: Tensor, call: "NoiseCall") -> Tensor:
        """A step's keyed noise for one NoiseBlock (keys as in :meth:`_forward`): [B, 1, length]."""
        return keyed_normal(keys[2], keys[3], keys[1], call.per_frame, call.start, call.length, call.index,
                            dtype=call.dtype)


def joined_audio(pieces: Sequence[Tensor]) -> tuple[Tensor, np.ndarray]:
    """1-D audio pieces -> (one buffer, offsets int64 [len(pieces) + 1]) as :meth:`StreamEngine.step_rows` returns."""
    offsets = np.zeros(len(pieces) + 1, np.int64)
    np.cumsum([p.numel() for p in pieces], out=offsets[1:])
    return torch.cat(list(pieces)), offsets


def _host_numpy(codes: Tensor) -> np.ndarray:
    """A tensor's values as a numpy array of its dtype (a view on the CPU)."""
    return codes.numpy() if codes.is_cpu else codes.cpu().numpy()


def _int64_numpy(codes: Tensor) -> np.ndarray:
    """An integer tensor's values as an int64 numpy array (a view where it already is one on the CPU)."""
    a = _host_numpy(codes)
    return a if a.dtype == np.int64 else a.astype(np.int64)


def _slots_of(streams: Sequence[StreamSlot]) -> np.ndarray:
    """The state slots of ``streams``, int64 [len(streams)]."""
    return np.fromiter((s.slot for s in streams), np.int64, len(streams))


