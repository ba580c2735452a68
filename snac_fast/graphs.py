"""CUDA graphs for decode: one captured graph per input shape and noise source, in a bounded LRU cache.

A fused decode is 36 kernels; at streaming sizes launching them, and everything the call does
around them, costs as much as the GPU work. A call here does little besides one graph launch:

- the codes go into the graph's static buffer in one copy (levels flattened one after another);
- ids are range-checked without a host sync before the launch: on the CPU for CPU codes; for GPU
  codes the graph's codebook kernel raises a flag, read once the decode has finished (a bad id then
  raises ValueError naming it, and the audio is discarded);
- the NoiseBlocks read static noise buffers. Fresh noise (no generator) is one draw for all of them
  inside the graph, from the default CUDA generator, whose state advances on every replay as on
  every eager call; with a generator the noise is drawn outside, in the same order as an eager
  decode, so seeds give the same audio with or without graphs;
- the output is cloned, unless the caller asks for the static buffer.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from snac_fast.codes import check_code_ids
from snac_fast.noise import draw, noise_blocks


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    codes: Tensor  # static flat buffer: each level flattened, one after another
    noise: Tensor  # static noise, all NoiseBlock calls one after another (the graph reads it: keep it alive)
    noise_views: list[Tensor]  # seeded graphs: its part per NoiseBlock call, in call order, filled per call
    output: Tensor
    bad_ids: Tensor  # int32 [1]: the codebook kernel sets it when an id is out of range ...
    bad_ids_host: Tensor  # ... and the graph copies it here (pinned) and clears it


class GraphedDecode:
    """Replays ``model.decode`` from CUDA graphs keyed by the codes' shapes and dtypes and by whether
    the noise comes from a caller's generator.

    max_graphs bounds the cache; the least recently used graph (and its memory pool) is dropped.
    """

    def __init__(self, model: nn.Module, device: torch.device, max_graphs: int = 8, warmup: int = 2) -> None:
        if max_graphs < 1:
            raise ValueError("max_graphs must be at least 1")
        self.model = model
        self.device = torch.device(device)
        self.max_graphs = max_graphs
        self.warmup = warmup
        self.codebook_size = model.quantizer.quantizers[0].codebook.num_embeddings
        self._cache: OrderedDict[tuple, _Captured] = OrderedDict()
        self.captures = 0  # how many graphs were captured so far (evictions make this exceed len)

    def __len__(self) -> int:
        return len(self._cache)

    def keys(self) -> list[tuple]:
        return list(self._cache)

    def clear(self) -> None:
        self._cache.clear()

    @staticmethod
    def key(codes: list[Tensor], seeded: bool = False) -> tuple:
        return tuple((tuple(c.shape), c.dtype) for c in codes) + (seeded,)

    def knows(self, codes: object) -> bool:
        """True when ``codes`` have the shapes and dtypes of a cached graph's codes: they pass the
        structural checks that those passed (the checks depend on nothing else), so a replay can
        skip them."""
        try:
            return any(self.key(codes, seeded) in self._cache for seeded in (False, True))
        except (TypeError, AttributeError):
            return False

    def __call__(self, codes: list[Tensor], generator: torch.Generator | None = None, copy_output: bool = True) -> Tensor:
        """codes: structurally validated (ids not yet checked), on any device. generator: None draws
        fresh noise from the default CUDA generator, as upstream does. copy_output=False returns the
        graph's static output buffer, which the next call of the same shape overwrites."""
        key = self.key(codes, generator is not None)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._capture(codes, generator is not None)
            self._cache[key] = entry
            while len(self._cache) > self.max_graphs:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        on_cpu = all(c.device.type == "cpu" for c in codes)
        if on_cpu:  # check on the CPU: no sync with the GPU
            flat = torch.cat([c.reshape(-1) for c in codes])
            lo, hi = flat.aminmax()
            if lo < 0 or hi >= self.codebook_size:
                check_code_ids(codes, self.codebook_size)
            entry.codes.copy_(flat, non_blocking=True)
        else:
            torch.cat([c.reshape(-1).to(entry.codes.device, entry.codes.dtype) for c in codes], out=entry.codes)
        for view in entry.noise_views:  # the same draws, in the same order, as an eager decode
            view.copy_(draw(tuple(view.shape), generator, view))
        entry.graph.replay()
        output = entry.output.clone() if copy_output else entry.output
        if not on_cpu:  # wait for the decode (the caller would, to use the audio), then read its flag
            torch.cuda.current_stream(self.device).synchronize()
            if entry.bad_ids_host.item():
                check_code_ids(codes, self.codebook_size)
        return output

    def _capture(self, codes: list[Tensor], seeded: bool) -> _Captured:
        blocks = noise_blocks(self.model)
        quantizer = self.model.quantizer
        dtype = functools.reduce(torch.promote_types, [c.dtype for c in codes])
        flat = torch.cat([c.reshape(-1).to(self.device, dtype) for c in codes])
        static_codes, offset = [], 0
        for c in codes:
            static_codes.append(flat[offset:offset + c.numel()].view(c.shape))
            offset += c.numel()
        bad_ids = torch.zeros(1, dtype=torch.int32, device=self.device)
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
            quantizer.bad_ids = bad_ids
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.inference_mode(), torch.cuda.stream(stream):  # compile kernels, settle allocations
                for block in blocks:
                    block.draw_noise = record
                out = self.model.decode(static_codes)
                noise = torch.randn(sum(b * t for b, _, t in shapes), device=out.device, dtype=out.dtype)
                del out
                offset = 0
                for b, _, t in shapes:
                    views.append(noise[offset:offset + b * t].view(b, 1, t))
                    offset += b * t
                for block in blocks:
                    block.draw_noise = replay_buffers
                for _ in range(self.warmup):
                    self.model.decode(static_codes)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            bad_ids_host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            with torch.inference_mode(), torch.cuda.graph(graph):
                if not seeded:  # one draw for all blocks, advancing the default generator on each replay
                    noise.normal_()
                output = self.model.decode(static_codes)
                bad_ids_host.copy_(bad_ids, non_blocking=True)
                bad_ids.zero_()
        finally:
            quantizer.bad_ids = None
            for block in blocks:
                if "draw_noise" in vars(block):
                    del block.draw_noise
        bad_ids.zero_()  # the warm-up decodes may have flagged the first codes: the call checks them itself
        self.captures += 1
        return _Captured(graph, flat, noise, views if seeded else [], output, bad_ids, bad_ids_host)
