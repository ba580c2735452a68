"""Launch rules shared by the kernels: programmatic dependent launch, TMA, how many programs fill
the GPU, tile choices recorded and replayed across a stream engine's shapes, and GEMM
configurations that shrink until they fit a card."""

from __future__ import annotations

import contextlib
import contextvars
import os
import warnings
from collections.abc import Callable

import torch

from snac_fast.ops.device import HAS_TRITON, gpu_limits, interpreter_configs

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def await_previous_kernel(PDL: tl.constexpr):
        """First statement of every forward kernel. Launched with programmatic dependent launch
        (PDL), a kernel may start while the one before it on the stream is still running: wait
        here until that one has finished and its writes are visible (before touching any
        activation), then let the next kernel launch early in turn."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()


def dependent_launch(device: torch.device, programs: int) -> bool:
    """Whether a launch of ``programs`` programs on ``device`` uses programmatic dependent launch:
    CUDA compute capability 9.0+ (Hopper), compiled Triton, not switched off with
    ``SNAC_FAST_PDL=0``, and a grid of at most a few programs per SM. A streaming decode is a
    chain of short single-wave kernels; PDL overlaps each one's launch with the end of the one
    before. Long grids lose by it: their next kernel's waiting programs take SM slots from the last
    wave (both measured: docs/measurements.md). The bound is 8 waves (:func:`wave_programs`)."""
    limits = gpu_limits(device)
    if limits is None or os.environ.get("SNAC_FAST_PDL", "1") == "0":
        return False
    return programs <= 8 * wave_programs(device) and limits.capability >= (9, 0)


def has_tma(device: torch.device) -> bool:
    """Whether compiled Triton kernels on ``device`` can move tiles with the Tensor Memory
    Accelerator (CUDA compute capability 9.0+: Hopper and later)."""
    limits = gpu_limits(device)
    return HAS_TRITON and limits is not None and limits.capability >= (9, 0)


def launch_flags(device: torch.device, programs: int, pdl: bool | None = None) -> dict[str, bool]:
    """Keyword arguments for a forward kernel's launch: its PDL constexpr and Triton's launch_pdl
    (``pdl``: a choice made already, such as a recorded one)."""
    pdl = dependent_launch(device, programs) if pdl is None else pdl
    return {"PDL": pdl, "launch_pdl": pdl}


_rows_per_tile_choice = contextvars.ContextVar("rows_per_tile_choice", default=1)


@contextlib.contextmanager
def tiles_as_for_fewer_rows(factor: int):
    """Inside, the launch rules choose tiles (and dependent launch) as for a launch ``factor`` times
    smaller: the programs a launch must fill the GPU with, and the bound on dependent launches, scale
    by it. A stream engine's steps of 2-8 rows take the 1-row step's tiles this way, so warming them
    compiles no kernel variants of their own (docs/cold_start.md)."""
    token = _rows_per_tile_choice.set(max(1, int(factor)))
    try:
        yield
    finally:
        _rows_per_tile_choice.reset(token)


_recorded_launches = contextvars.ContextVar("recorded_launches", default=None)


@contextlib.contextmanager
def launches_as_recorded(memo: dict, record: bool):
    """Inside, each launcher that asks :func:`launch_choice` takes the choice ``memo`` holds for its
    key (its tiles, warps, dependent launch), and with ``record`` adds the choices it makes. A
    stream engine records its one-frame step's launches per batch bucket and runs that bucket's
    prefill and flush with them: their lengths differ from the step's, and choices of their own would
    be kernel variants of their own, a third more compiles at a cold start (docs/cold_start.md)."""
    token = _recorded_launches.set((memo, record))
    try:
        yield
    finally:
        _recorded_launches.reset(token)


def launch_choice(key: tuple, choose: Callable[[], object], fits: Callable[[object], bool] = lambda choice: True):
    """``choose()``, or inside :func:`launches_as_recorded` the choice recorded under ``key`` where
    ``fits(choice)`` says it is valid for this launch (the key names a layer's launch: everything the
    choice depends on but the length and alignment). Recording launches keep their own choices:
    where two share a key, the first one's is recorded."""
    scope = _recorded_launches.get()
    if scope is None or interpreter_configs():  # the interpreter compiles nothing: its own big tiles
        return choose()
    memo, record = scope
    if record:
        choice = choose()
        memo.setdefault(key, choice)
        return choice
    return memo[key] if key in memo and fits(memo[key]) else choose()


def wave_programs(device: torch.device) -> int:
    """How many programs a launch needs to occupy ``device``: its SM count rounded down to a power
    of two (128 on H100/H200), times :func:`tiles_as_for_fewer_rows`' factor. 1 for Triton's
    interpreter, which pays per program: biggest tiles."""
    limits = gpu_limits(device)
    return 1 if limits is None else _power_of_two_below(limits.sms) * _rows_per_tile_choice.get()


def _power_of_two_below(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def first_filling(tiles: list[tuple[int, ...]], programs, target: int) -> tuple[int, ...]:
    """The first tile (in order of preference, biggest first) whose launch has at least ``target``
    programs, else the last. Small problems get small tiles so that every SM works: at streaming
    sizes a decoder kernel is latency-bound, not bandwidth-bound (scripts/tune_tiles.py)."""
    for tile in tiles:
        if programs(tile) >= target:
            return tile
    return tiles[-1]


GemmConfig = tuple[int, int, int, int, int]  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
_fitted: dict[tuple, GemmConfig] = {}


def smaller_gemm_config(config: GemmConfig) -> GemmConfig | None:
    """The next configuration to try when one does not fit: one pipeline stage fewer, then half the
    K step, then half the column tile (shared memory is stages x (BLOCK_M + BLOCK_N) x BLOCK_K)."""
    block_m, block_n, block_k, warps, stages = config
    if stages > 1:
        return block_m, block_n, block_k, warps, stages - 1
    if block_k > 16:
        return block_m, block_n, block_k // 2, warps, stages
    if block_n > 16:
        return block_m, block_n // 2, block_k, warps, stages
    return None


def launch_fitting(key: tuple, config: GemmConfig, launch: Callable[[GemmConfig], object]):
    """``launch(config)``; where the device refuses it for its resources (Triton's OutOfResources:
    the shared memory or registers of a card the rules did not foresee), the first of
    :func:`smaller_gemm_config`'s configurations that launches, remembered per ``key`` and config
    (one warning each) so later calls go straight to it."""
    from triton.runtime.errors import OutOfResources

    fitted = _fitted.get((key, config), config)
    while True:
        try:
            return launch(fitted)
        except OutOfResources as error:
            smaller = smaller_gemm_config(fitted)
            if smaller is None:
                raise
            if (key, config) not in _fitted:
                warnings.warn(f"{key[0]}: configuration {config} does not fit this GPU ({error}); "
                              "using smaller ones", RuntimeWarning, stacklevel=3)
            fitted = _fitted[(key, config)] = smaller
