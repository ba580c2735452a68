"""A stream engine's steps: one batched step of some kind for some state rows, run through its
captured CUDA graph or the stage forward; which step sizes run; and the warm-up that compiles every
kernel and captures every CUDA graph a server's steps will need, before the first stream."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from snac_fast.ops.device import cuda_index, device_scope
from snac_fast.runtime.compiling import compiling_concurrently
from snac_fast.runtime.graphs import out_of_memory_explained
from snac_fast.streaming.shapes import (
    CODELESS,
    FLUSH,
    PREFILL,
    STEP,
    TAIL,
    bucket_rows,
    joined_audio,
    warmup_buckets,
)
from snac_fast.streaming.stage_forward import StageForward
from snac_fast.streaming.step_graph import StepGraph

POOL_ROUNDING = 2 << 20  # the caching allocator's large segments are whole 2 MiB pages
POOL_SLACK = 1.1  # room for the graphs' outputs, which stay allocated in the pool


class StepRunner:
    """A :class:`~snac_fast.streaming.StreamEngine`'s steps (a part of the engine): it runs one kind
    of step for some state rows through ``forward`` (the engine's :class:`StageForward`), on CUDA
    as a captured graph per (kind, batch bucket, frames) shape, at most ``max_graphs`` of them, all
    in one memory pool; plans step sizes; and warms up. ``slots``: the engine's state rows and keys
    (:class:`~snac_fast.streaming.slots.SlotTable`); ``checks``: its code checks; ``timing``: its
    facts of time (:class:`~snac_fast.streaming.lookahead.StreamTiming`)."""

    def __init__(self, forward: StageForward, state: list[torch.Tensor], slots, checks, timing, *,
                 max_frames_per_step: int, cuda_graphs: bool, max_graphs: int, lock) -> None:
        self.forward, self.state, self.slots, self.checks, self.timing = forward, state, slots, checks, timing
        self.device, self.dtype = state[0].device, state[0].dtype
        self.max_streams, self.ratios = slots.max_streams, checks.ratios
        group = timing.frames_per_group
        self.max_frames_per_step = max(group, max_frames_per_step // group * group)
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs a CUDA device")
        self.cuda_graphs, self.max_graphs, self.lock = cuda_graphs, max_graphs, lock
        self.graphs: dict[tuple, StepGraph] = {}
        # after a warm-up: the step shapes (STEP, bucket, frames) warmed. A step of more frames than
        # a warmed one then runs as one-group steps: capturing its graph mid-serving held the first
        # audio of a server's first streams for 85-250 ms (docs/http_server.md)
        self.warmed: set[tuple] | None = None
        # one memory pool for every step graph (they replay one at a time), which the warm-up's eager
        # passes use too; reserved as one segment before the first (_reserve_pool)
        self.pool = torch.cuda.MemPool() if cuda_graphs else None
        self._pool_reserved = False
        self._graph_streams: tuple | None = None  # (capture, side), made at the first capture

    def drop_graphs(self) -> None:
        """Forget every captured graph and the warmed shapes (the step they captured has changed);
        the pool stays reserved."""
        self.graphs.clear()
        self.warmed = None

    # -- one batched step ----------------------------------------------------------------------

    def bucket(self, n: int) -> int:
        """Rows of the batch that runs n streams: :func:`bucket_rows` (at most max_streams) under CUDA graphs."""
        return min(bucket_rows(n), self.max_streams) if self.cuda_graphs else n

    def run(self, kind: str, keys: np.ndarray, codes: list[np.ndarray], frames: int, n: int) -> torch.Tensor:
        """One step of ``kind`` for the ``n`` streams of ``keys`` (int64 [4, bucket],
        :meth:`SlotTable.write_keys`) taking ``frames`` frames, ``codes`` per level int64 [n, L_i]
        (none for a flush or tail); returns their new audio, [n, samples] (row j: keys' row j)."""
        if not self.cuda_graphs:
            return self.forward(kind, torch.from_numpy(keys).to(self.device),
                                [torch.from_numpy(c).to(self.device) for c in codes], frames)[:n, 0]
        bucket = keys.shape[1]
        key = (kind, bucket, frames)
        graph = self.graphs.get(key)
        if graph is None:
            if len(self.graphs) >= self.max_graphs:
                self.graphs.pop(next(iter(self.graphs)))
            padded = [np.pad(level, ((0, bucket - n), (0, 0))) for level in codes]  # the graph's shapes
            with out_of_memory_explained(f"capturing a stream step's CUDA graph ({kind}, {bucket} rows)"):
                graph = self.graphs[key] = self._step_graph(kind, keys, padded, frames)
        # rows past n keep earlier calls' codes: valid codes, decoded into the scratch slot
        return graph(keys, codes)[:n, 0].clone()  # the next replay overwrites the graph's output

    def replay(self, slots: np.ndarray, codes: list[np.ndarray], frames: int, ids_checked: bool,
               keys: np.ndarray | None) -> torch.Tensor | None:
        """A server's steady-state step of ``frames`` for the streams of ``slots`` through its
        captured graph, the codes (per level [len(slots), L_i], any integer dtype) and keys written
        straight into the graph's pinned inputs and the ids checked there (one reduction) before any
        state changes; the streams' frames consumed counted after the launch. ``keys``: the batch's
        key rows (all but the frames consumed, which change every step), or None to write them.
        Returns the audio [len(slots), samples], or None where no graph of that shape is captured."""
        n = len(slots)
        graph = self.graphs.get((STEP, self.bucket(n), frames)) if self.cuda_graphs else None
        if graph is None:
            return None
        graph_keys, *levels = graph.inputs()
        if keys is None:
            self.slots.write_keys(graph_keys, slots)
        else:
            graph_keys[...] = keys
            np.take(self.slots.consumed, slots, out=graph_keys[1, :n])
        for level, c in zip(levels, codes):
            level[:n] = c
            if n < len(level):  # padding rows: code 0
                level[n:] = 0
        if not ids_checked and graph.unsigned_codes.max() >= self.checks.codebook_size:  # negatives wrap high
            self.checks.check_ids([codes])  # names the level and the id
            raise ValueError(f"codes hold ids outside [0, {self.checks.codebook_size})")
        with device_scope(self.device):
            audio = graph.launch()[:n, 0].clone()  # the next replay overwrites the graph's output
        self.slots.consumed[slots] += frames  # after the launch: host work the GPU's step hides
        return audio

    # -- graphs and the warm-up ----------------------------------------------------------------

    def _step_graph(self, kind: str, keys: np.ndarray, codes: list[np.ndarray], frames: int,
                    compiled: bool = False) -> StepGraph:
        return StepGraph(self.forward, StageForward.draw_noise, self.state, self.pool, self._capture_streams(), kind,
                         keys, codes, frames, compiled)

    def _capture_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The engine's (capture, side) CUDA streams, made at the first use."""
        if self._graph_streams is None:
            self._graph_streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        return self._graph_streams

    @contextlib.contextmanager
    def _in_graph_pool(self) -> Iterator[None]:
        """This thread's allocations from the step graphs' pool, on their capture stream (the caching
        allocator reuses a freed block only on the stream that allocated it)."""
        with torch.cuda.stream(self._capture_streams()[0]), torch.cuda.use_mem_pool(self.pool, cuda_index(self.device)):
            yield

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
        shapes = self.warmup_shapes(max_batch, frames)
        inputs = self.warmup_inputs(shapes)
        with self.lock, torch.inference_mode(), device_scope(self.device):
            self._reserve_pool(shapes)
            if not compiled:
                self.launch_shapes(inputs)
            for shape, (keys, codes) in inputs.items():
                graph = self.graphs[shape] = self._step_graph(shape[0], keys, codes, shape[2], compiled=True)
                graph(keys, codes)  # a first replay uploads the graph: the first stream's step does not wait for it
            # the first launches of what a batch of mixed prefills and steps adds (lazily loaded kernels)
            joined_audio([torch.zeros(n, device=self.device, dtype=self.dtype) for n in (0, 3)])
        torch.cuda.synchronize(self.device)
        self.warmed = (self.warmed or set()) | {shape for shape in shapes if shape[0] == STEP}
        return len(inputs)

    def compile_steps(self, max_batch: int | None = None, frames: Sequence[int] = ()) -> None:
        """Compile the kernels of the steps :meth:`warmup` captures for these arguments, without
        capturing: one shapes-only pass in which every kernel compiles concurrently. Inside a caller's
        :func:`~snac_fast.runtime.compiling.compiling_concurrently` block they join that block's compiles
        (:func:`snac_fast.runtime.warmup.warmup` compiles the decode shapes and the steps in one pass)."""
        if not self.cuda_graphs:
            return
        shapes = self.warmup_shapes(max_batch, frames)
        inputs = self.warmup_inputs(shapes)
        with self.lock, torch.inference_mode(), device_scope(self.device):
            self._reserve_pool(shapes)
            self.launch_shapes(inputs)

    def warmup_shapes(self, max_batch: int | None, frames: Sequence[int]) -> list[tuple[str, int, int]]:
        top = min(max_batch or self.max_streams, self.max_streams)
        # the largest bucket first: the graphs share one memory pool, and a smaller graph's blocks fit
        # in a larger one's, never the other way (captured smallest first, a 256-stream warm-up's pool
        # grew to about the sum of every bucket's: 2.9 GB on an H200)
        buckets = sorted({self.bucket(b) for b in warmup_buckets(top)}, reverse=True)
        more = sorted({self.step_frames(int(k)) for k in frames} - {0, self.timing.frames_per_group})
        # each bucket's one-frame step first: it records the launches the others reuse
        shapes = [(kind, b, k) for b in buckets for kind, k in
                  [(STEP, k) for k in [self.timing.frames_per_group, *more]] + [(PREFILL, self.timing.prefill_frames), (FLUSH, 0)]
                  + ([(TAIL, 0)] if self.timing.approximate_lookahead is not None else [])]
        if len(shapes) > self.max_graphs:
            raise ValueError(f"warmup needs {len(shapes)} graphs but the engine keeps {self.max_graphs}: "
                             "raise max_graphs or warm fewer shapes")
        return shapes

    def warmup_inputs(self, shapes: list[tuple[str, int, int]]) -> dict:
        """Scratch-row keys and zero codes for each shape not captured yet."""
        return self._shape_inputs([shape for shape in shapes if shape not in self.graphs])

    def _shape_inputs(self, shapes: list[tuple[str, int, int]]) -> dict:
        """Scratch-row keys and zero codes for each shape."""
        inputs = {}
        for kind, bucket, k in shapes:
            keys = np.zeros((4, bucket), np.int64)
            keys[0] = self.max_streams  # the scratch row
            inputs[kind, bucket, k] = keys, [] if kind in CODELESS else [np.zeros((bucket, k * r), np.int64) for r in self.ratios]
        return inputs

    def launch_shapes(self, inputs: dict) -> None:
        """One shapes-only pass over every step first: all their kernels compile at once, instead of
        each graph's compiling while the others wait (an empty Triton cache). Its blocks come from
        the graphs' pool, once reserved: the pass needs no reserve of its own."""
        with self._in_graph_pool() if self._pool_reserved else contextlib.nullcontext(), compiling_concurrently():
            for (kind, bucket, k), (keys, codes) in inputs.items():
                self.forward(kind, torch.from_numpy(keys).to(self.device),
                              [torch.from_numpy(c).to(self.device) for c in codes], k)

    def intermediates(self, rows: int) -> int:
        """Bytes the largest step of ``rows`` rows (a prefill, a one-group step or a flush) allocates
        beyond what is live before it, measured by a shapes-only pass (no kernel runs; it compiles
        those not compiled yet). CUDA only."""
        # the one-group step first: it records the launch choices the others reuse (ops.launch)
        return self._peak_of([(STEP, rows, self.timing.frames_per_group), (PREFILL, rows, self.timing.prefill_frames), (FLUSH, rows, 0)])

    def _peak_of(self, shapes: list[tuple[str, int, int]]) -> int:
        """The most bytes one of ``shapes`` allocates beyond what is live before it (a shapes-only pass).
        It resets the device's peak memory statistics (``torch.cuda.reset_peak_memory_stats``): a
        caller's peak reading spans only what follows."""
        most = 0
        with self.lock, torch.inference_mode(), device_scope(self.device):
            for shape, (keys, codes) in self._shape_inputs(shapes).items():
                torch.cuda.synchronize(self.device)
                before = torch.cuda.memory_allocated(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                self.launch_shapes({shape: (keys, codes)})
                most = max(most, torch.cuda.max_memory_allocated(self.device) - before)
        return most

    def _reserve_pool(self, shapes: list[tuple[str, int, int]]) -> None:
        """Once, before the first pass or capture into it: the graphs' pool reserved as one segment a
        little larger than the largest step's intermediates (the graphs' outputs stay in it). The
        passes and the captures then split and merge blocks of that one segment; left to grow on
        demand, the pool came to twice the largest step's (1.97 GB for 0.94 GB on an H200, 256
        streams: each request's segment too small for the next's)."""
        if self.pool is None or self._pool_reserved or not shapes:
            return
        top = max(bucket for _, bucket, _ in shapes)
        most = self._peak_of([shape for shape in shapes if shape[1] == top])
        torch.cuda.empty_cache()  # the measuring pass's blocks, back before the pool takes its own
        size = -(-int(most * POOL_SLACK) // POOL_ROUNDING) * POOL_ROUNDING
        with self._in_graph_pool():
            block = torch.empty(size, dtype=torch.uint8, device=self.device)
        del block  # free in the pool: what the passes and captures take their blocks from
        self._pool_reserved = True

    def step_frames(self, pending: int) -> int:
        """The largest step of a power-of-two number of groups that fits what a stream holds."""
        groups = min(int(pending), self.max_frames_per_step) // self.timing.frames_per_group
        return (1 << groups.bit_length() - 1) * self.timing.frames_per_group if groups > 0 else 0

    def runnable_frames(self, streams: int, frames: int) -> int:
        """The frames a step of ``streams`` streams holding ``frames`` takes: all of them, unless a
        warm-up fixed the step shapes and theirs is not among them (then one group)."""
        if self.warmed is None or frames == self.timing.frames_per_group:
            return frames
        return frames if (STEP, self.bucket(streams), frames) in self.warmed else self.timing.frames_per_group

    def step_frames_of(self, pending: np.ndarray) -> np.ndarray:
        """:meth:`step_frames` of every entry of an int array (0 where not a group is held)."""
        groups = np.minimum(pending, self.max_frames_per_step) // self.timing.frames_per_group
        bits = np.frexp(groups.astype(np.float64))[1]  # bit_length, exact for these small counts
        return np.where(groups > 0, np.left_shift(1, np.maximum(bits - 1, 0)) * self.timing.frames_per_group, 0)
