"""Cold start: compile every Triton kernel a server will launch before the first request.

:func:`compile_kernels` runs the decodes of the given shapes (and a stream engine's steps) once
under :func:`snac_fast.runtime.compiling.compiling_concurrently`, so their kernel variants compile
concurrently (on a thread pool) instead of one by one at their first launch; the compiled kernels land in
Triton's persistent cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``), which a container
build can bake. :func:`warmup` then runs real decodes of those shapes (CUDA graph captures,
cuDNN/cuBLAS start-up) and, if asked, every stream-engine step shape.

With a warm cache the compile pass only loads kernels, yet walking every shape's launches cost
most of a warm start (a 256-stream engine: 1.5-2.0 of 2.2-3.0 s on H100 hosts). So each pass writes a
manifest of the cache files it used (``snac_fast_warmups/`` in Triton's cache directory), keyed
by everything that decides the kernels (model config, dtype, shapes, engine, device, versions,
this package's source, ``TRITON_*``/``SNAC_FAST_*`` settings); when the manifest of the same key
finds all its files, the pass is skipped and the captures load the kernels as they first launch.
A file gone since only costs speed: that kernel compiles at its first launch.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch

from snac_fast.ops.device import device_scope
from snac_fast.runtime.compiling import compiling_concurrently
from snac_fast.runtime.graphs import KEYED


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
    manifest = _manifest_path(codec, shapes, engine, streams)
    if manifest is not None and _all_cached(manifest):
        return time.perf_counter() - start
    with torch.inference_mode(), device_scope(codec.device), compiling_concurrently(workers) as cached_files:
        for batch, frames in shapes:
            _launch_decode(codec, _zero_codes(codec, batch, frames))
        if engine is not None:
            engine.compile_steps(max_batch=streams)
    if manifest is not None and cached_files:
        _write_manifest(manifest, cached_files)
    return time.perf_counter() - start


def _manifest_path(codec, shapes: Sequence[tuple[int, int]], engine, streams: int) -> Path | None:
    """Where the manifest of this compile pass lives, or None where Triton's cache is not plain
    files (a custom or remote cache manager) or compiles always."""
    try:
        import triton
        from triton import knobs
    except ImportError:
        return None
    if knobs.cache.manager_class is not None or knobs.compilation.always_compile or not knobs.cache.dir:
        return None
    engine_key = None if engine is None else [engine.max_streams, engine.frames_per_group, engine.prefill_frames,
                                             engine.approximate_lookahead, engine.cuda_graphs, streams]
    key = json.dumps({
        "config": codec.config, "dtype": str(codec.dtype), "graphs": codec.graphs is not None,
        "shapes": [list(shape) for shape in shapes], "engine": engine_key,
        "device": [torch.cuda.get_device_name(codec.device), list(torch.cuda.get_device_capability(codec.device))],
        "versions": [torch.__version__, torch.version.cuda, triton.__version__], "source": _source_digest(),
        "env": sorted((k, v) for k, v in os.environ.items() if k.startswith(("TRITON_", "SNAC_FAST_"))),
    }, sort_keys=True, default=str)
    return Path(knobs.cache.dir) / "snac_fast_warmups" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


@functools.cache
def _source_digest() -> str:
    """A digest of this package's Python source (its launch rules decide the kernel variants)."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _all_cached(manifest: Path) -> bool:
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return bool(files) and all(os.path.exists(f) for f in files)


def _write_manifest(manifest: Path, files: list[str]) -> None:
    """Written whole or not at all (a temporary file renamed); a cache directory that cannot be
    written only loses the shortcut."""
    try:
        manifest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=manifest.parent, suffix=".tmp", delete=False) as f:
            json.dump({"files": sorted(set(files))}, f)
        os.replace(f.name, manifest)
    except OSError:
        pass


def warmup(codec, batch_sizes: Sequence[int] = (1,), frames: Sequence[int] = (4,), streams: int = 0,
           workers: int | None = None, lookahead: int | str | None = None) -> dict[str, float]:
    """Get ``codec`` ready to serve: compile the kernels of every (batch, frames) decode and, with
    ``streams`` > 0, of the steps of the shared stream engine (:meth:`FastSNAC.shared_stream_engine`,
    grown to ``streams`` slots if smaller; the one of ``lookahead``) for batches of up to that many
    streams, all concurrently; then decode each shape once (CUDA graphs captured) and capture the
    engine's steps, and hand the warm-up's transient memory back to the device. Returns seconds per
    phase: ``compile_s``, ``decode_s``, ``stream_s``."""
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
    if codec.device.type == "cuda":
        # the eager passes' blocks stay cached in the allocator (the graphs' own pool is theirs):
        # handed back, a server's reserve is what it serves with
        torch.cuda.empty_cache()
    return times


def _launch_decode(codec, codes: list[torch.Tensor]) -> None:
    """Launch what ``codec.decode(codes, seed=0)`` launches, as :func:`warmup` calls it: its graph
    capture's pass (the same static inputs, id flag and keyed noise: a plain decode of these codes
    launched three variants the capture then compiled one by one, ~1 s of a cold start) or, without
    CUDA graphs, the eager decode."""
    if codec.graphs is not None:
        codec.graphs.compile_kernels(codes, KEYED)
    else:
        codec.decode(codes, seed=0)


def _zero_codes(codec, batch: int, frames: int) -> list[torch.Tensor]:
    strides = codec.config["vq_strides"]
    if batch < 1 or frames < 1:
        raise ValueError(f"warm-up shapes need batch >= 1 and frames >= 1, got batch {batch}, frames {frames}")
    window = codec.config.get("attn_window_size")
    if window:  # whole attention windows, as decode requires
        per = window // strides[0]
        frames = -(-frames // per) * per
    return [torch.zeros((batch, frames * strides[0] // s), dtype=torch.int64, device=codec.device) for s in strides]
