"""GPU memory of a serving process: what it holds, and a stream engine's warm-up sized to a budget.

A stream engine holds its weights, its state rows (``max_streams`` of them) and one memory pool that
all its step graphs share (they replay one at a time, on one capture stream), reserved as one
segment a tenth larger than the largest step's intermediates, which grow with its rows (up to
``rows_per_pass``, where the stages run on slices of a step's rows); the
warm-up's eager passes run inside it too. :func:`fit_max_batch` measures those intermediates at
two small batch buckets (a shapes-only pass: no kernel runs), extrapolates them by rows and
returns the largest bucket whose warm-up fits a budget; calls of more streams then run as several
steps.
"""

from __future__ import annotations

import os

import torch

from snac_fast.ops.device import cuda_index
from snac_fast.streaming.shapes import warmup_buckets

GB = 1e9
# the CUDA context, cuBLAS and the loaded kernels: what a process holds outside torch's allocator
# where NVML cannot say (seen on an H200 with torch 2.11: see docs/http_server.md, "GPU memory")
CONTEXT_BYTES_ESTIMATE = int(0.6 * GB)
# the pool (the largest step's intermediates and a tenth: StepRunner._reserve_pool), with the
# allocator's rounding and the graphs' small outputs on top
WARMUP_FACTOR = 1.25
CALIBRATION_ROWS = (16, 64)


def process_bytes(device: torch.device | str) -> int | None:
    """GPU memory this process holds on ``device`` as nvidia-smi counts it (NVML, from the serve
    extra's nvidia-ml-py), or None where NVML is missing or lists no such process (a container
    that hides other pid namespaces' processes, say)."""
    try:
        import pynvml

        if not _nvml_ready:
            pynvml.nvmlInit()
            _nvml_ready.append(True)
        handle = _nvml_handle(cuda_index(torch.device(device)))
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return int(proc.usedGpuMemory)
    except Exception:  # noqa: BLE001 - no NVML library, no driver, no permission
        return None
    return None


_nvml_ready: list = []  # nvmlInit() done once per process


def _nvml_handle(index: int):
    """NVML's handle of CUDA device ``index``, found by its UUID: NVML numbers every GPU of the host,
    CUDA only the visible ones (with CUDA_VISIBLE_DEVICES=2, CUDA's 0 is NVML's 2)."""
    import pynvml

    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
    except pynvml.NVMLError:  # no UUID from torch, or a MIG instance's: NVML's numbering
        return pynvml.nvmlDeviceGetHandleByIndex(index)


def memory_readings(device: torch.device | str) -> dict[str, float]:
    """The process's GPU memory in bytes: ``gpu_reserved_bytes`` (torch's caching allocator),
    ``gpu_allocated_bytes`` (in live tensors) and, where NVML tells, ``gpu_process_bytes`` (all of
    it, the CUDA context included). Empty off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    readings = {"gpu_reserved_bytes": float(torch.cuda.memory_reserved(device)),
                "gpu_allocated_bytes": float(torch.cuda.memory_allocated(device))}
    held = process_bytes(device)
    if held is not None:
        readings["gpu_process_bytes"] = float(held)
    return readings


def context_bytes(device: torch.device) -> int:
    """What this process holds outside torch's allocator: NVML's figure less the reserve, else the estimate."""
    held = process_bytes(device)
    if held is None:
        return CONTEXT_BYTES_ESTIMATE
    return max(0, held - torch.cuda.memory_reserved(device))


def fit_max_batch(engine, budget_bytes: int, max_batch: int) -> tuple[int, dict]:
    """The largest batch bucket up to ``max_batch`` whose step graphs (and their warm-up) fit in
    ``budget_bytes`` of GPU memory for the whole process, given what it holds now (weights, the
    engine's state rows) and its CUDA context. Returns (that bucket, the figures it was chosen
    from); raises ValueError naming what does not fit when not even one-row steps do."""
    device = engine.device
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved(device) + context_bytes(device)
    # measured within one slice of the step's rows (engine.rows_per_pass): a larger step's are a slice's
    r2 = min(CALIBRATION_ROWS[1], engine.rows_per_pass or CALIBRATION_ROWS[1])
    r1 = min(CALIBRATION_ROWS[0], max(1, r2 // 4))
    m1, m2 = engine.intermediates(r1), engine.intermediates(r2)
    torch.cuda.empty_cache()
    per_row = max(0.0, (m2 - m1) / (r2 - r1)) if r2 > r1 else m2 / r2
    fixed = max(0.0, m1 - per_row * r1) if r2 > r1 else 0.0
    state = sum(t.numel() * t.element_size() for t in engine.state)
    return choose_max_batch(budget_bytes, held, fixed, per_row, max_batch,
                            f"{state / GB:.2f} GB of state for {engine.max_streams} streams", engine.rows_per_pass)


def choose_max_batch(budget_bytes: float, held: float, fixed: float, per_row: float, max_batch: int,
                     state: str = "", rows_per_pass: int | None = None) -> tuple[int, dict]:
    """The largest warm-up bucket up to ``max_batch`` whose steps need at most ``budget_bytes`` with
    ``held`` bytes held already, a step of r rows allocating ``fixed + per_row * min(r, rows_per_pass)``
    (its stages run on slices of at most ``rows_per_pass`` rows; None: all at once); (bucket,
    figures). ValueError when not one row fits."""
    def need(rows: int) -> float:
        return held + WARMUP_FACTOR * (fixed + per_row * min(rows, rows_per_pass or rows))

    figures = {"budget_gb": round(budget_bytes / GB, 3), "held_gb": round(held / GB, 3),
               "per_row_mb": round(per_row / 1e6, 3), "fixed_mb": round(fixed / 1e6, 1)}
    fitting = [b for b in warmup_buckets(max_batch) if need(b) <= budget_bytes]
    if not fitting:
        raise ValueError(
            f"--gpu-memory-gb {budget_bytes / GB:g} does not fit this engine: the process holds {held / GB:.2f} GB "
            f"(the CUDA context, the weights{' and ' + state if state else ''}) and one-stream steps need "
            f"{(need(1) - held) / 1e6:.0f} MB more: raise the budget or lower --max-streams")
    top = fitting[-1]
    figures.update(max_batch=top, need_gb=round(need(top) / GB, 3))
    return top, figures
