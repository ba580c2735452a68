"""Per-layer decode timing: the fast model against the original upstream one, layer by layer.

Forward hooks put CUDA events (wall clock on CPU) around every decoder layer, DecoderBlock, residual
unit, Snake, convolution, transposed convolution, NoiseBlock and attention; ``quantizer.from_codes``
is timed as one row. Each model is warmed up, then timed over several runs; rows hold medians. On a
GPU the launches are queued behind a spin kernel, so rows are GPU time without host gaps. Top-level
rows come from a pass that times only them (a CUDA event costs about a microsecond of GPU time, and
nested rows add hundreds of events); nested rows from a pass that times everything. An untimed decode
(events only around the whole call, queued the same way) is measured too: ``timed_total_ms`` (the
top-level rows added up) against ``untimed_ms`` shows what the hooks cost; and the eager latency of a
plain call (host overhead included), which is what an eager caller waits.

Fused layers run their children inside their kernels, and absorbed layers (Absorbed*: a snake, the
input 1x1 conv, the tanh) run inside a neighbour's kernel, so those rows have times for the original
model only (``fast_ms`` is None).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from snac_fast.codes import validate_codes
from snac_fast.model.surgery import to_device_dtype


def _timed_classes() -> tuple[type, ...]:
    """Layer classes that get a row; subclasses (parametrized, fused, absorbed) included."""
    from snac.attention import LocalMHA
    from snac.layers import DecoderBlock, NoiseBlock, ResidualUnit, Snake1d

    from snac_fast.model.modules import FastSnake1d

    return (Snake1d, FastSnake1d, nn.Conv1d, nn.ConvTranspose1d, NoiseBlock, ResidualUnit, DecoderBlock,
            LocalMHA, nn.Tanh)


@dataclass
class LayerTiming:
    name: str
    kind: str
    depth: int  # 0: top level (quantizer, the decoder's direct children); deeper rows are inside them
    shape: list[int]  # output shape
    fast_ms: float | None  # None: runs inside a fused parent's kernels
    original_ms: float | None  # None: the original was not profiled
    share: float | None  # fast_ms / the fast model's untimed decode time

    @property
    def speedup(self) -> float | None:
        return self.original_ms / self.fast_ms if self.original_ms and self.fast_ms else None


@dataclass
class ProfileReport:
    device: str
    fast_dtype: str
    original_dtype: str | None
    runs: int
    layers: list[LayerTiming] = field(default_factory=list)
    fast_untimed_ms: float = 0.0  # GPU time of a decode without hooks (launches queued ahead)
    fast_timed_total_ms: float = 0.0  # the top-level rows added up
    fast_eager_ms: float = 0.0  # latency of a plain eager call, host overhead included
    original_untimed_ms: float | None = None
    original_timed_total_ms: float | None = None
    original_eager_ms: float | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        for row, layer in zip(d["layers"], self.layers):
            row["speedup"] = layer.speedup
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        unit = "ms"
        head = (f"decode profile on {self.device}: fast {self.fast_dtype} vs original "
                f"{self.original_dtype or '(not run)'}, median of {self.runs} runs")
        lines = [head, f"{'layer':<44} {'type':<16} {'out shape':<18} {'fast ' + unit:>9} {'orig ' + unit:>9} {'speedup':>8} {'share':>6}"]
        for r in self.layers:
            fast = f"{r.fast_ms:9.3f}" if r.fast_ms is not None else f"{'(fused)':>9}"
            orig = f"{r.original_ms:9.3f}" if r.original_ms is not None else f"{'-':>9}"
            sp = f"{r.speedup:7.2f}x" if r.speedup is not None else f"{'-':>8}"
            share = f"{100 * r.share:5.1f}%" if r.share is not None else f"{'-':>6}"
            name = "  " * r.depth + r.name
            lines.append(f"{name:<44.44} {r.kind:<16.16} {'x'.join(map(str, r.shape)):<18.18} {fast} {orig} {sp} {share}")
        lines.append(f"fast: untimed decode {self.fast_untimed_ms:.3f} ms, top-level rows add up to "
                     f"{self.fast_timed_total_ms:.3f} ms; eager call latency {self.fast_eager_ms:.3f} ms")
        if self.original_untimed_ms is not None:
            lines.append(f"original: untimed decode {self.original_untimed_ms:.3f} ms, top-level rows add up to "
                         f"{self.original_timed_total_ms:.3f} ms; eager call latency {self.original_eager_ms:.3f} ms")
            lines.append(f"speedup: {self.original_untimed_ms / self.fast_untimed_ms:.2f}x decode time, "
                         f"{self.original_eager_ms / self.fast_eager_ms:.2f}x eager latency")
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """Bar chart of the top-level rows, fast vs original (needs the ``plot`` extra: matplotlib)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = [r for r in self.layers if r.depth == 0]
        fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
        y = range(len(rows))
        ax.barh([i + 0.2 for i in y], [r.fast_ms or 0 for r in rows], height=0.4, label=f"snac-fast {self.fast_dtype}")
        if self.original_dtype:
            ax.barh([i - 0.2 for i in y], [r.original_ms or 0 for r in rows], height=0.4, label=f"original {self.original_dtype}")
        ax.set_yticks(list(y), [f"{r.name} ({r.kind})" for r in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("ms (median)")
        ax.set_title(f"SNAC decode per layer, {self.device}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


class _Clock:
    """CUDA events on a GPU, perf_counter on the CPU.

    On a GPU, :meth:`hold` first queues a spin kernel long enough for Python to enqueue the whole
    decode behind it: the events then time the GPU's work back to back, not the gaps where the GPU
    waits for the host (which hooks would inflate). Eager latency is measured separately.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.cycles_per_ms = 0.0
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1000)  # warm the spin kernel
            start.record()
            torch.cuda._sleep(2_000_000)
            end.record()
            end.synchronize()
            self.cycles_per_ms = 2_000_000 / start.elapsed_time(end)

    def hold(self, ms: float) -> None:
        if self.cuda:
            torch.cuda._sleep(int(ms * self.cycles_per_ms))

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _timed_modules(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """(name, module, depth): the decoder's direct children, and every module of a timed class
    inside them; depth counts timed ancestors."""
    top = {f"decoder.model.{i}" for i in range(len(model.decoder.model))}
    timed = _timed_classes()
    picked = [(name, m) for name, m in model.decoder.named_modules(prefix="decoder")
              if name in top or (name.count(".") > 2 and isinstance(m, timed))]
    names = [n for n, _ in picked]
    return [(n, m, sum(n.startswith(other + ".") for other in names)) for n, m in picked]


def time_decode(model: nn.Module, codes: list[Tensor], device: torch.device, runs: int, warmup: int):
    """(rows {name: (kind, depth, shape, [ms per run])}, untimed GPU ms per run, eager ms per run).

    Two hooked passes: one timing only the top-level rows (their events then add little to a
    decode), whose rows are kept; one timing every row, kept for the nested rows only."""
    clock = _Clock(device)
    codes = [c.to(device) for c in codes]
    nested, _ = _hooked_runs(model, codes, clock, runs, warmup, top_only=False)
    rows, host_ms = _hooked_runs(model, codes, clock, runs, warmup, top_only=True)
    for name, row in nested.items():
        rows.setdefault(name, row)
    untimed, eager = [], []
    with torch.inference_mode():
        for run in range(warmup + 2 * runs):
            queued = warmup <= run < warmup + runs
            clock.hold(1.5 * host_ms + 1.0 if queued else 0.0)
            start = clock.mark()
            model.decode(codes)
            end = clock.mark()
            clock.sync()
            if run >= warmup:
                (untimed if queued else eager).append(clock.elapsed_ms(start, end))
    return rows, untimed, eager


def _hooked_runs(model, codes, clock, runs, warmup, top_only):
    marks: dict[str, list] = {}
    shapes: dict[str, list[int]] = {}
    handles = []
    from snac_fast.model.modules import Absorbed

    # absorbed layers run inside a neighbour's kernel: no row of their own (they would time nothing)
    selected = [(n, m, d) for n, m, d in _timed_modules(model) if (d == 0 or not top_only) and not isinstance(m, Absorbed)]
    for name, module, _ in selected:
        def pre(mod, args, name=name):
            marks.setdefault(name, []).append(clock.mark())

        def post(mod, args, out, name=name):
            marks[name].append(clock.mark())
            out = out[0] if isinstance(out, tuple) else out  # (y, snake(y)) pairs: y
            shapes.setdefault(name, list(out.shape) if isinstance(out, Tensor) else [])

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    per_run: dict[str, list[float]] = {}
    host_ms = 0.0  # how long Python takes to enqueue one hooked decode
    with torch.inference_mode():
        try:
            for run in range(warmup + runs):
                marks.clear()
                clock.hold(1.5 * host_ms + 1.0 if run >= warmup else 0.0)
                t0 = time.perf_counter()
                q0 = clock.mark()
                z = model.quantizer.from_codes(codes)
                q1 = clock.mark()
                model.decoder(z)
                host_ms = max(host_ms, (time.perf_counter() - t0) * 1e3) if run < warmup else host_ms
                clock.sync()
                if run < warmup:
                    continue
                per_run.setdefault("quantizer.from_codes", []).append(clock.elapsed_ms(q0, q1))
                shapes.setdefault("quantizer.from_codes", list(z.shape))
                for name, ms in marks.items():
                    per_run.setdefault(name, []).append(clock.elapsed_ms(ms[0], ms[1]))
        finally:
            for h in handles:
                h.remove()
    kinds = {name: (type(m).__name__, depth) for name, m, depth in selected}
    kinds["quantizer.from_codes"] = ("ResidualVQ", 0)
    return {name: (*kinds[name], shapes.get(name, []), times) for name, times in per_run.items()}, host_ms


def profile(
    fast,
    codes: list[Tensor],
    *,
    runs: int = 10,
    warmup: int = 3,
    original: bool = True,
    original_dtype: torch.dtype | None = None,
) -> ProfileReport:
    """Time each decoder layer of ``fast`` (a FastSNAC) and of the original upstream model.

    original_dtype: the original's dtype (default: the fast model's, so the rows compare the same
    precision; pass torch.float32 to compare against upstream as it ships).
    """
    codes = validate_codes(codes, fast.config)
    fast_rows, fast_untimed, fast_eager = time_decode(fast.model, codes, fast.device, runs, warmup)
    report = ProfileReport(device=_device_name(fast.device), fast_dtype=str(fast.dtype).replace("torch.", ""),
                           original_dtype=None, runs=runs)
    report.fast_untimed_ms = statistics.median(fast_untimed)
    report.fast_eager_ms = statistics.median(fast_eager)
    orig_rows: dict = {}
    if original:
        dtype = original_dtype or fast.dtype
        ref = fast.reference_model()
        to_device_dtype(ref, fast.device, dtype)
        orig_rows, orig_untimed, orig_eager = time_decode(ref, codes, fast.device, runs, warmup)
        del ref
        if fast.device.type == "cuda":
            torch.cuda.empty_cache()
        report.original_dtype = str(dtype).replace("torch.", "")
        report.original_untimed_ms = statistics.median(orig_untimed)
        report.original_eager_ms = statistics.median(orig_eager)
        report.original_timed_total_ms = sum(statistics.median(t[3]) for t in orig_rows.values() if t[1] == 0)
    layout = {n: (type(m).__name__, d) for n, m, d in _timed_modules(fast.model)}  # kinds as in the fast tree
    layout["quantizer.from_codes"] = ("ResidualVQ", 0)
    for name in ["quantizer.from_codes"] + list(layout)[:-1]:
        fast_row, orig = fast_rows.get(name), orig_rows.get(name)
        if fast_row is None and orig is None:
            continue
        (kind, depth), shape, times = layout[name], (fast_row or orig)[2], (fast_row or orig)[3]
        fast_ms = statistics.median(times) if fast_row else None
        share = fast_ms / report.fast_untimed_ms if fast_ms is not None and report.fast_untimed_ms else None
        report.layers.append(LayerTiming(name, kind, depth, shape, fast_ms,
                                         statistics.median(orig[3]) if orig else None, share))
    report.fast_timed_total_ms = sum(r.fast_ms for r in report.layers if r.depth == 0 and r.fast_ms is not None)
    return report


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"
