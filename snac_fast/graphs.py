"""CUDA graphs for decode: one captured graph per input shape, in a bounded LRU cache.

A decode launches a few hundred small kernels; at streaming sizes the GPU waits on Python between
them. Replaying a captured graph launches them all at once. Inputs are copied into the graph's
static buffers; the NoiseBlocks read static noise buffers that are refilled before every replay
from the caller's generator (the same draws, in the same order, as an eager decode), so seeds give
the same audio in both modes. The output is cloned unless the caller asks for the static buffer.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from snac_fast.noise import draw, noise_blocks


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    codes: list[Tensor]  # static inputs
    noise: Tensor  # one flat buffer ...
    noise_views: list[Tensor]  # ... sliced per NoiseBlock call, in call order
    output: Tensor


class GraphedDecode:
    """Replays ``model.decode`` from CUDA graphs keyed by the codes' shapes and dtypes.

    max_graphs bounds the cache; the least recently used graph (and its memory pool) is dropped.
    """

    def __init__(self, model: nn.Module, max_graphs: int = 8, warmup: int = 2) -> None:
        if max_graphs < 1:
            raise ValueError("max_graphs must be at least 1")
        self.model = model
        self.max_graphs = max_graphs
        self.warmup = warmup
        self._cache: OrderedDict[tuple, _Captured] = OrderedDict()
        self.captures = 0  # how many graphs were captured so far (evictions make this exceed len)

    def __len__(self) -> int:
        return len(self._cache)

    def keys(self) -> list[tuple]:
        return list(self._cache)

    def clear(self) -> None:
        self._cache.clear()

    @staticmethod
    def key(codes: list[Tensor]) -> tuple:
        return tuple((tuple(c.shape), c.dtype) for c in codes)

    def __call__(self, codes: list[Tensor], generator: torch.Generator | None = None, copy_output: bool = True) -> Tensor:
        """codes: validated, on the model's CUDA device. generator: None draws noise from the global
        RNG, as upstream does. copy_output=False returns the graph's static output buffer, which the
        next call of the same shape overwrites."""
        key = self.key(codes)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._capture(codes)
            self._cache[key] = entry
            while len(self._cache) > self.max_graphs:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        for static, c in zip(entry.codes, codes):
            static.copy_(c, non_blocking=True)
        if generator is None:  # fresh noise, nothing to reproduce: one in-place draw for all blocks
            entry.noise.normal_()
        else:  # the same draws, in the same order, as an eager decode with this generator
            for view in entry.noise_views:
                view.copy_(draw(tuple(view.shape), generator, view))
        entry.graph.replay()
        return entry.output.clone() if copy_output else entry.output

    def _capture(self, codes: list[Tensor]) -> _Captured:
        blocks = noise_blocks(self.model)
        static_codes = [c.clone() for c in codes]
        shapes: list[tuple[int, int, int]] = []
        views: list[Tensor] = []
        calls = 0

        def record(x: Tensor) -> Tensor:  # first pass: learn each NoiseBlock call's shape
            shapes.append((x.shape[0], 1, x.shape[2]))
            return torch.randn(shapes[-1], device=x.device, dtype=x.dtype)

        def replay_buffers(x: Tensor) -> Tensor:
            nonlocal calls
            view = views[calls % len(views)]
            calls += 1
            return view

        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.inference_mode(), torch.cuda.stream(stream):  # compile kernels, settle allocations
                for block in blocks:
                    block.draw_noise = record
                out = self.model.decode(static_codes)
                flat = torch.empty(sum(b * t for b, _, t in shapes), device=out.device, dtype=out.dtype)
                del out
                offsets = [0]
                for b, _, t in shapes:
                    offsets.append(offsets[-1] + b * t)
                views.extend(flat[o:o + b * t].view(b, 1, t) for o, (b, _, t) in zip(offsets, shapes))
                for block in blocks:
                    block.draw_noise = replay_buffers
                for _ in range(self.warmup):
                    self.model.decode(static_codes)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph):
                output = self.model.decode(static_codes)
        finally:
            for block in blocks:
                if "draw_noise" in vars(block):
                    del block.draw_noise
        self.captures += 1
        return _Captured(graph, static_codes, flat, views, output)
