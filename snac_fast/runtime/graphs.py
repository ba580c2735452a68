"""CUDA graphs for decode: one captured graph per input shape and noise source, in a bounded LRU cache.

A fused decode is 36 kernels; at streaming sizes launching them, and everything the call does
around them, costs as much as the GPU work. A call here does little besides one graph launch:

- the codes go into the graph's static buffer in one copy (levels flattened one after another);
- ids are range-checked without a host sync before the launch: on the CPU for CPU codes; for GPU
  codes the graph's codebook kernel raises a flag in pinned host memory (written through its
  mapped address: no copy node), read once the decode has finished (a bad id then raises
  ValueError naming it, and the audio is discarded);
- shapes seen before skip the structural checks (the cache key is computed once per call);
- the NoiseBlocks' noise: fresh noise (no seed, no generator) is one draw for all of them inside
  the graph, from the default CUDA generator, whose state advances on every replay as on every
  eager call; a seed is written to a static buffer that the graph's keyed-noise kernels read
  (:mod:`snac_fast.ops.noise`); with a generator the noise is drawn outside, in the same order as
  an eager decode. Seeds and generators give the same audio with or without graphs;
- the output is cloned, unless the caller asks for the static buffer.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch
from torch import Tensor, nn

from snac_fast.codes import check_code_ids
from snac_fast.model.noise import draw, keyed_noise, patched_noise
from snac_fast.ops.device import cuda_index, device_scope
from snac_fast.runtime.compiling import compiling_concurrently


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    codes: Tensor  # static flat buffer: each level flattened, one after another
    noise: Tensor | None  # static noise, all NoiseBlock calls one after another (the graph reads it: keep it alive)
    noise_views: list[Tensor]  # generator graphs: its part per NoiseBlock call, in call order, filled per call
    seeds: Tensor | None  # keyed graphs: int64 [B], the seed of every row, filled per call
    output: Tensor
    bad_ids: Tensor  # int32 [1] in mapped host memory (mapped_flag): the codebook kernel sets it for an out-of-range id

    def __post_init__(self) -> None:
        self.flag = self.bad_ids.numpy()  # reading it costs no torch dispatch


FRESH, KEYED, GENERATOR = "fresh", "keyed", "generator"  # where a graph's noise comes from


class GraphCache:
    """A bounded LRU cache of captured CUDA graphs: ``max_graphs`` entries, the least recently used
    one (and its memory pool) dropped first; ``captures`` counts every capture so far."""

    def __init__(self, max_graphs: int) -> None:
        if max_graphs < 1:
            raise ValueError("max_graphs must be at least 1")
        self.max_graphs = max_graphs
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self.captures = 0

    def __len__(self) -> int:
        return len(self._cache)

    def keys(self) -> list[tuple]:
        return list(self._cache)

    def __contains__(self, key: tuple) -> bool:
        return key in self._cache

    def clear(self) -> None:
        self._cache.clear()

    def _captured(self, key: tuple, capture: Callable[[], object], what: str) -> object:
        """The entry for ``key``, now the most recently used; a missing one is captured first
        (``what`` names the input in an out-of-memory error) and the oldest beyond the bound dropped."""
        entry = self._cache.get(key)
        if entry is None:
            with out_of_memory_explained(f"capturing a CUDA graph for {what}"):
                entry = capture()
            self._cache[key] = entry
            self.captures += 1
            while len(self._cache) > self.max_graphs:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return entry


class GraphedDecode(GraphCache):
    """Replays ``model.decode`` from CUDA graphs keyed by the codes' shapes and dtypes and by where
    the noise comes from (fresh, keyed by a seed, or a caller's generator).

    max_graphs bounds the cache; the least recently used graph (and its memory pool) is dropped.
    """

    def __init__(self, model: nn.Module, device: torch.device, max_graphs: int = 8, warmup: int = 2) -> None:
        super().__init__(max_graphs)
        self.model = model
        self.device = torch.device(device)
        self.warmup = warmup
        self.codebook_size = model.quantizer.quantizers[0].codebook.num_embeddings
        self._index = cuda_index(self.device) if self.device.type == "cuda" else -1

    @staticmethod
    def key(codes: list[Tensor], noise: str = FRESH) -> tuple:
        return (*[(c.shape, c.dtype) for c in codes], noise)  # torch.Size is a tuple

    def __call__(self, codes: list[Tensor], generator: torch.Generator | None = None, copy_output: bool = True,
                 validate: Callable[[list[Tensor]], object] | None = None, seed: int | None = None) -> Tensor:
        """codes: one integer tensor per level, on any device; ``validate(codes)`` runs the
        structural checks before a capture (the shapes and dtypes of a cached graph passed them
        already: they depend on nothing else); ids are checked here. seed: position-keyed noise
        (row b keyed by (seed, b)); generator: draws in call order; neither: fresh noise from the
        default CUDA generator, as upstream does. copy_output=False returns the graph's static
        output buffer, which the next call of the same shape overwrites."""
        noise = GENERATOR if generator is not None else KEYED if seed is not None else FRESH
        try:
            key = self.key(codes, noise)
            entry = self._cache.get(key)
        except (TypeError, AttributeError):  # not a list of tensors: validate says what is wrong
            key = entry = None
        if entry is None:
            if validate is not None:
                validate(codes)
            if key is None:  # validate accepted what key() could not read
                key = self.key(codes, noise)
        entry = self._captured(key, lambda: self._capture(codes, noise),
                               f"codes of shapes {[tuple(c.shape) for c in codes]}")
        static = entry.codes
        on_cpu = all(c.is_cpu for c in codes)  # (attributes, not torch.device objects: this runs per call)
        if on_cpu:  # check on the CPU: no sync with the GPU
            flat = torch.cat([c.reshape(-1) for c in codes])
            lo, hi = flat.aminmax()
            if lo < 0 or hi >= self.codebook_size:
                check_code_ids(codes, self.codebook_size)
            static.copy_(flat, non_blocking=True)
        elif all(c.get_device() == self._index and c.dtype == static.dtype for c in codes):
            torch.cat([c.reshape(-1) for c in codes], out=static)
        else:
            torch.cat([c.reshape(-1).to(static.device, static.dtype) for c in codes], out=static)
        for view in entry.noise_views:  # the same draws, in the same order, as an eager decode
            view.copy_(draw(tuple(view.shape), generator, view))
        if entry.seeds is not None:
            entry.seeds.fill_(seed)
        entry.graph.replay()
        output = entry.output.clone() if copy_output else entry.output
        if not on_cpu:  # wait for the decode (the caller would, to use the audio), then read its flag
            torch.cuda.current_stream(self.device).synchronize()
            if entry.flag[0]:
                entry.flag[0] = 0
                check_code_ids(codes, self.codebook_size)
        return output

    def _capture(self, codes: list[Tensor], noise_kind: str) -> _Captured:
        with device_scope(self.device):  # side streams and the graph on the model's device, whichever is current
            return self._capture_here(codes, noise_kind)

    def compile_kernels(self, codes: list[Tensor], noise_kind: str = KEYED) -> None:
        """Inside :func:`~snac_fast.runtime.compiling.compiling_concurrently`: launch (compile only) the
        kernels that capturing a graph for these codes and noise kind launches, with the same
        static inputs, id flag and noise (a decode of separate code tensors without them launched
        other variants: aligned pointers, no flag, no keyed noise). Nothing is captured or cached."""
        with device_scope(self.device):
            _, static_codes, bad_ids, keys = self._static_inputs(codes, noise_kind)

            def record(index: int, x: Tensor) -> Tensor:
                return torch.randn((x.shape[0], 1, x.shape[2]), device=x.device, dtype=x.dtype)

            self._shapes_only_pass(static_codes, bad_ids, keyed_noise(self.model, *keys) if noise_kind == KEYED
                                   else patched_noise(self.model, record))

    def _static_inputs(self, codes: list[Tensor], noise_kind: str):
        """(flat codes buffer, its per-level views, the mapped id flag, the keyed noise's keys or None)."""
        dtype = functools.reduce(torch.promote_types, [c.dtype for c in codes])
        with torch.inference_mode(False):  # buffers the calls write, in or out of inference mode
            flat = torch.cat([c.reshape(-1).to(self.device, dtype) for c in codes])
            bad_ids = mapped_flag()
            # keyed: (seeds, rows, frame offsets = 0) in one buffer; the graph reads all three, the seeds view keeps them alive
            keys = torch.zeros((3, codes[0].shape[0]), dtype=torch.int64, device=self.device) if noise_kind == KEYED else None
            if keys is not None:
                keys[1] = torch.arange(codes[0].shape[0], device=self.device)
        static_codes, offset = [], 0
        for c in codes:
            static_codes.append(flat[offset:offset + c.numel()].view(c.shape))
            offset += c.numel()
        return flat, static_codes, bad_ids, keys

    def _shapes_only_pass(self, static_codes: list[Tensor], bad_ids: Tensor, noise) -> None:
        """A decode whose kernels compile (concurrently) instead of running, under ``noise``."""
        quantizer = self.model.quantizer
        try:
            quantizer.bad_ids = bad_ids
            with torch.inference_mode(), compiling_concurrently(), noise:
                self.model.decode(static_codes)
        finally:
            quantizer.bad_ids = None

    def _capture_here(self, codes: list[Tensor], noise_kind: str) -> _Captured:
        quantizer = self.model.quantizer
        flat, static_codes, bad_ids, keys = self._static_inputs(codes, noise_kind)
        seeds = keys[0] if keys is not None else None
        shapes: list[tuple[int, int, int]] = []
        dtypes: list[torch.dtype] = []
        views: list[Tensor] = []
        calls = 0

        def record(index: int, x: Tensor) -> Tensor:  # first pass: learn each NoiseBlock call's shape
            shapes.append((x.shape[0], 1, x.shape[2]))
            dtypes.append(x.dtype)
            return torch.randn(shapes[-1], device=x.device, dtype=x.dtype)

        def replay_buffers(index: int, x: Tensor) -> Tensor:
            nonlocal calls
            view = views[calls % len(views)]
            calls += 1
            return view

        def noise_feed():
            return keyed_noise(self.model, *keys) if noise_kind == KEYED else patched_noise(self.model, replay_buffers)

        noise = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # a shapes-only pass: kernels compile concurrently instead of one by one
            self._shapes_only_pass(static_codes, bad_ids,
                                   patched_noise(self.model, record) if noise_kind != KEYED else noise_feed())
        try:
            quantizer.bad_ids = bad_ids
            with torch.inference_mode(), torch.cuda.stream(stream):  # settle allocations
                if noise_kind != KEYED:
                    with torch.inference_mode(False):
                        noise = torch.randn(sum(b * t for b, _, t in shapes), device=self.device, dtype=dtypes[0])
                    offset = 0
                    for b, _, t in shapes:
                        views.append(noise[offset:offset + b * t].view(b, 1, t))
                        offset += b * t
                with noise_feed():
                    for _ in range(self.warmup):
                        self.model.decode(static_codes)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # a capture stream of this device: torch.cuda.graph's default one belongs to the device of the first capture
            with torch.inference_mode(), noise_feed(), torch.cuda.graph(graph, stream=torch.cuda.Stream(self.device)):
                if noise_kind == FRESH:  # one draw for all blocks, advancing the default generator on each replay
                    noise.normal_()
                output = self.model.decode(static_codes)
        finally:
            quantizer.bad_ids = None
        torch.cuda.current_stream().synchronize()
        bad_ids.zero_()  # the warm-up decodes may have flagged the first codes: the call checks them itself
        return _Captured(graph, flat, noise, views if noise_kind == GENERATOR else [], seeds, output, bad_ids)


@contextlib.contextmanager
def out_of_memory_explained(what: str) -> Iterator[None]:
    """Turn a GPU out-of-memory error while ``what`` into a RuntimeError saying what to do; the
    half-made graph is dropped and the codec stays usable."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        torch.cuda.empty_cache()
        raise RuntimeError(f"GPU out of memory while {what}: decode smaller batches or shorter codes, keep fewer "
                           "graphs (max_graphs), or build with cuda_graphs=False. The codec is still usable.") from error


def mapped_flag() -> Tensor:
    """int32 [1] (zero) in page-locked host memory that the GPU kernels of every device in the process
    can write through its address (registered portable and mapped). PyTorch's pinned tensors are
    pinned for the context that allocated them only, so a model on cuda:1 could not use one made
    while cuda:0 was current."""
    page = mmap.mmap(-1, mmap.PAGESIZE)  # a page of its own: registrations never overlap
    flag = torch.from_numpy(np.frombuffer(page, dtype=np.int32, count=1))
    address = flag.data_ptr()
    error = int(torch.cuda.cudart().cudaHostRegister(address, mmap.PAGESIZE, 3))  # portable | mapped
    if error:
        raise RuntimeError(f"cannot page-lock the bad-id flag (cudaHostRegister error {error})")
    weakref.finalize(flag, _unregister, address, page)
    return flag


def _unregister(address: int, page: mmap.mmap) -> None:  # page: kept mapped until unregistered
    torch.cuda.cudart().cudaHostUnregister(address)
