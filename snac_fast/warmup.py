"""Cold start: compile every Triton kernel a server will launch before the first request.

:func:`compile_kernels` runs the decodes of the given shapes (and a stream engine's steps) once
under :func:`snac_fast.compiling.compiling_concurrently`, so their kernel variants compile
concurrently (on a thread pool) instead of one by one at their first launch; the compiled kernels land in
Triton's persistent cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``), which a container
build can bake. :func:`warmup` then runs real decodes of those shapes (CUDA graph captures,
cuDNN/cuBLAS start-up) and, if asked, every stream-engine step shape.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from snac_fast.compiling import compiling_concurrently
from snac_fast.graphs import KEYED
from snac_fast.ops._runtime import device_scope


def compile_kernels(codec, shapes: Sequence[tuple[int, int]], workers: int | None = None, engine=None,
                    streams: int = 0) -> float:
    """Compile, concurrently, the Triton kernels that decodes of ``shapes`` ((batch, coarse frames)
    pairs) launch on ``codec``'s GPU, and with an ``engine`` those of its steps for batches of up to
    ``streams`` streams (:meth:`~snac_fast.streaming.StreamEngine.compile_steps`), without running
    them: one pass, so every variant joins one pool (compiled in two passes, the first one's last
    compiles left most cores idle for ~2 s). Returns the seconds it took. A no-op off CUDA."""
    if codec.device.type != "cuda":
        return 0.0
    start = time.perf_counter()
    with torch.inference_mode(), device_scope(codec.device), compiling_concurrently(workers):
        for batch, frames in shapes:
            _launch_decode(codec, _zero_codes(codec, batch, frames))
        if engine is not None:
            engine.compile_steps(max_batch=streams)
    return time.perf_counter() - start


def warmup(codec, batch_sizes: Sequence[int] = (1,), frames: Sequence[int] = (4,), streams: int = 0,
           workers: int | None = None, lookahead: int | str | None = None) -> dict[str, float]:
    """Get ``codec`` ready to serve: compile the kernels of every (batch, frames) decode and, with
    ``streams`` > 0, of the steps of the shared stream engine (:meth:`FastSNAC.shared_stream_engine`,
    grown to ``streams`` slots if smaller; the one of ``lookahead``) for batches of up to that many
    streams, all concurrently; then decode each shape once (CUDA graphs captured) and capture the
    engine's steps. Returns seconds per phase: ``compile_s``, ``decode_s``, ``stream_s``."""
    engine = None
    if streams:
        engine = codec.shared_stream_engine(lookahead)
        if engine.max_streams < streams:
            engine = codec.shared_stream_engine(lookahead, max_streams=streams)
    times = {"compile_s": compile_kernels(codec, [(b, f) for b in batch_sizes for f in frames], workers,
                                          engine, streams)}
    start = time.perf_counter()
    for b in batch_sizes:
        for f in frames:
            codec.decode(_zero_codes(codec, b, f), seed=0)
    if codec.device.type == "cuda":
        torch.cuda.synchronize(codec.device)
    times["decode_s"] = time.perf_counter() - start
    if engine is not None:
        start = time.perf_counter()
        engine.warmup(max_batch=streams, compiled=True)
        times["stream_s"] = time.perf_counter() - start
    return times


def _launch_decode(codec, codes: list[torch.Tensor]) -> None:
    """Launch what ``codec.decode(codes, seed=0)`` launches, as :func:`warmup` calls it: its graph
    capture's pass (the same static inputs, id flag and keyed noise: a plain decode of these codes
    launched three variants the capture then compiled one by one, ~1 s of a cold start) or, without
    CUDA graphs, the eager decode."""
    if codec.graphs is not None:
        codec.graphs.compile_kernels(codes, KEYED)
    else:
        codec._decode(codes, 0, None, False)


def _zero_codes(codec, batch: int, frames: int) -> list[torch.Tensor]:
    strides = codec.config["vq_strides"]
    if batch < 1 or frames < 1:
        raise ValueError(f"warm-up shapes need batch >= 1 and frames >= 1, got batch {batch}, frames {frames}")
    window = codec.config.get("attn_window_size")
    if window:  # whole attention windows, as decode requires
        per = window // strides[0]
        frames = -(-frames // per) * per
    return [torch.zeros((batch, frames * strides[0] // s), dtype=torch.int64, device=codec.device) for s in strides]
