"""One stream-engine step captured as a CUDA graph, with its pinned inputs and keyed noise."""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import numpy as np
import torch
from torch import Tensor

from snac_fast.ops.device import cuda_index
from snac_fast.runtime.compiling import compiling_concurrently


class NoiseCall(NamedTuple):
    """One NoiseBlock's noise in a step: block ``index``, positions ``frames consumed * per_frame +
    start + t`` for t < ``length``, in ``dtype``."""

    index: int
    per_frame: int
    start: int
    length: int
    dtype: torch.dtype


# the engine's step on device tensors: (kind, keys, codes, frames, noise_for or None) -> audio
Forward = Callable[[str, Tensor, list, int, Optional[Callable[[NoiseCall], Tensor]]], Tensor]


# Not yet run on a GPU, so off (CONTRIBUTING.md): each graph's persistent buffers (its noise and its
# output, one copy at the graph's end) taken outside the graphs' pool before its capture. Kept in the
# pool, they fragment it: on an H100 the 256-stream pool came to 1.311 GB in 18 segments for 0.853 GB
# of intermediates, the first graph's output splitting the reserved segment (docs/history.md, issue 87)
BUFFERS_OUTSIDE_POOL = False


class StepGraph:
    """One captured step: static keys and codes in (one pinned host buffer, uploaded by the graph's
    first node), static audio out. Call it with new inputs, or write them into :meth:`inputs` and
    :meth:`launch` it. ``forward``, ``draw_noise``, ``state``, ``pool``: the engine's step, its
    keyed noise, its state tensors (restored after the warm-up runs) and graph memory pool (a ``torch.cuda.MemPool``).
    ``streams``: the engine's (capture, side) CUDA streams, the same for all its graphs: the caching
    allocator reuses a freed block only on the stream that allocated it, so a stream per graph held
    every graph's warm-up and capture memory apart (docs/http_server.md, "GPU memory").
    ``compiled``: the step's kernels were compiled already (a warm-up's pass)."""

    def __init__(self, forward: Forward, draw_noise: Callable[..., Tensor], state: list[Tensor], pool,
                 streams: tuple[torch.cuda.Stream, torch.cuda.Stream], kind: str, keys: np.ndarray,
                 codes: list[np.ndarray], frames: int, compiled: bool = False) -> None:
        device = state[0].device
        sizes = [keys.size] + [c.size for c in codes]
        # each view starts 16-byte aligned, as separate tensors do: Triton specializes aligned pointers,
        # so a misaligned level compiled a kernel variant of its own here, after the warm-up's pass
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + -(-size // 2) * 2)
        with torch.inference_mode(False):
            self.host = torch.zeros(starts[-1], dtype=torch.int64, pin_memory=True)  # padding stays 0: a valid id
            self.static = torch.empty_like(self.host, device=device)
        self.host_views, self.static_views = [], []
        for start, size, array in zip(starts, sizes, [keys, *codes]):
            self.host_views.append(self.host.numpy()[start:start + size].reshape(array.shape))
            self.static_views.append(self.static[start:start + size].view(array.shape))
        self.unsigned_codes = self.host.numpy()[starts[1]:].view(np.uint64)  # every level's codes (and padding), flat
        # recorded by each replay right after its upload: the pinned inputs are free again from then on
        self.copied = torch.cuda.Event(external=True)
        self._fill(keys, codes)
        self.static.copy_(self.host)
        keys_view, codes_views = self.static_views[0], self.static_views[1:]
        # warm up on a scratch copy of the state: compile kernels without touching any stream's context
        saved = [t.clone() for t in state]
        capture, side = streams
        stream = capture  # the eager passes too: their freed blocks serve the next graph's
        stream.wait_stream(torch.cuda.current_stream(device))
        noise_calls: list[NoiseCall] = []
        # in the graphs' pool: the eager passes' blocks are the capture's, not a second reserve beside it
        with torch.cuda.stream(stream), torch.inference_mode(), torch.cuda.use_mem_pool(pool, cuda_index(device)):
            if not compiled:  # a shapes-only pass: the kernels compile concurrently
                with compiling_concurrently():
                    forward(kind, keys_view, codes_views, frames, None)
            # one eager step loads its kernels and records its noise calls (the pass ran its torch ops
            # already); a second one before each capture cost a 256-stream warm-up ~0.3 s
            eager = forward(kind, keys_view, codes_views, frames,
                            lambda call: noise_calls.append(call) or draw_noise(keys_view, call))
            output_shape, output_dtype = eager.shape, eager.dtype
            del eager
        torch.cuda.current_stream(device).wait_stream(stream)
        rows = keys_view.shape[1]
        outside = BUFFERS_OUTSIDE_POOL
        if outside:  # this graph's persistent buffers, taken before its capture, outside the pool
            self.noise = {call.index: torch.empty((rows, 1, call.length), device=device, dtype=call.dtype)
                          for call in noise_calls}
            self.output = torch.empty(output_shape, device=device, dtype=output_dtype)
        self.graph = torch.cuda.CUDAGraph()
        capture.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.graph(self.graph, pool=pool.id, stream=capture):
            # the upload and its event inside the graph: a call costs one launch, not a copy, an event
            # record and a launch
            self.static.copy_(self.host, non_blocking=True)
            self.copied.record()
            # the noise depends on the keys alone: drawn on a branch of the graph that runs beside the
            # first layers, off the step's critical path (4 kernels; docs/measurements.md)
            # its buffers taken on the capture stream, from the pool's one segment: the allocator never
            # hands one stream's blocks to another, so buffers taken on the side stream each opened a
            # segment of their own in the pool, which the graph then held
            if not outside:
                self.noise = {call.index: torch.empty((rows, 1, call.length), device=device, dtype=call.dtype)
                              for call in noise_calls}
            side.wait_stream(capture)
            with torch.cuda.stream(side):
                for call in noise_calls:
                    draw_noise(keys_view, call, out=self.noise[call.index])
            drawn = torch.cuda.Event()
            drawn.record(side)
            joined = False

            def noise_for(call: NoiseCall) -> Tensor:
                nonlocal joined
                if not joined:
                    capture.wait_event(drawn)
                    joined = True
                if self.noise[call.index].shape[2] != call.length:
                    raise RuntimeError("a step graph's noise differs from its warm-up's")
                return self.noise[call.index]
            output = forward(kind, keys_view, codes_views, frames, noise_for)
            if outside:
                self.output.copy_(output)
                del output
            else:
                self.output = output
            if not joined:
                capture.wait_event(drawn)
        for t, s in zip(state, saved):
            t.copy_(s)

    def inputs(self) -> list[np.ndarray]:
        """The pinned host views to write a call's inputs into: keys int64 [4, B], then per level
        the codes int64 [B, L_i]; free once the previous call's copy has left them."""
        self.copied.synchronize()
        return self.host_views

    def launch(self) -> Tensor:
        """Replay (on the current stream, device current): upload what :meth:`inputs` holds and
        decode; returns the static output (audio [B, 1, samples]) that the next replay overwrites."""
        self.graph.replay()
        return self.output

    def _fill(self, keys: np.ndarray, codes: list[np.ndarray]) -> None:
        """keys: all B rows; codes: the first n <= B rows (the rest keep what they held)."""
        for view, array in zip(self.inputs(), [keys, *codes]):
            view[:len(array)] = array

    def __call__(self, keys: np.ndarray, codes: list[np.ndarray]) -> Tensor:
        self._fill(keys, codes)
        return self.launch()


