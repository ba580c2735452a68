"""End-to-end fidelity: a fast decode against the original upstream model on the same codes and noise.

Three decodes run one after another, each model freed before the next, so the check's peak memory is
the largest single decode's, not their sum:

1. the fast model as the user runs it;
2. the reference: a fresh original upstream SNAC (its own Snake1d, weight norm intact) in float32
   eager, TF32 off, on the fast model's device unless told otherwise;
3. the baseline: the same original model in the fast model's dtype, i.e. what plain upstream gives
   at that precision (its 32/44 kHz attention kept float32 as in snac-fast, since upstream's own
   cannot run in half; see :func:`snac_fast.model.surgery.keep_attention_float32`). Passing means the fast path is no less faithful than the baseline (within a
   margin) and above a floor.

Every decode draws its NoiseBlock noise from one CPU generator seeded with ``seed``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

from snac_fast.codes import validate_codes
from snac_fast.metrics import max_abs_error, rms, snr_db
from snac_fast.model.loading import Checkpoint, build_upstream
from snac_fast.model.noise import seeded_noise
from snac_fast.model.surgery import to_device_dtype
from snac_fast.ops.device import true_float32

# Thresholds per fast dtype, set 8-12 dB under the lowest SNR of the GPU fidelity matrix and 5-7x over
# its highest log-mel distance (docs/measurements.md); and reduced precision must also come within
# 0.2 dB of plain upstream at the same dtype on the same codes (the baseline decode).
SNR_FLOOR_DB = {torch.float32: 55.0, torch.float16: 50.0, torch.bfloat16: 32.0}
BASELINE_MARGIN_DB = 0.2
LOG_MEL_LIMIT_DB = {torch.float32: 0.02, torch.float16: 0.05, torch.bfloat16: 0.3}


@dataclass
class FidelityReport:
    """Fast vs reference on the same codes and noise; all signal figures over the whole batch."""

    snr_db: float
    max_abs_error: float
    rms_fast: float
    rms_reference: float
    log_mel_distance_db: float  # mean |log-mel(fast) - log-mel(reference)| in dB
    baseline_snr_db: float | None  # plain upstream in the fast dtype vs the reference (None: not run)
    fast_dtype: str
    fast_device: str
    reference_dtype: str
    reference_device: str
    seed: int
    samples: int
    thresholds: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=_json_number)

    def __str__(self) -> str:
        base = f"{self.baseline_snr_db:.2f} dB" if self.baseline_snr_db is not None else "not run"
        lines = [
            f"fidelity: {'PASS' if self.passed else 'FAIL'}  (fast {self.fast_dtype} on {self.fast_device} vs "
            f"original {self.reference_dtype} on {self.reference_device}, noise seed {self.seed}, {self.samples} samples)",
            f"  SNR                 {self.snr_db:8.2f} dB   (need >= {self.thresholds.get('min_snr_db', float('nan')):.2f})",
            f"  plain upstream {self.fast_dtype.replace('torch.', ''):<8} {base}",
            f"  max abs error       {self.max_abs_error:10.3g}",
            f"  log-mel distance    {self.log_mel_distance_db:10.4f} dB (need <= {self.thresholds.get('max_log_mel_db', float('nan')):.3g})",
            f"  RMS fast/reference  {self.rms_fast:.5f} / {self.rms_reference:.5f}",
        ]
        lines += [f"  failed: {f}" for f in self.failures]
        return "\n".join(lines)


def _json_number(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x


def log_mel_distance_db(reference: Tensor, estimate: Tensor, sampling_rate: int, n_mels: int = 80) -> float:
    """Mean absolute difference of log-mel power spectrograms (dB), 1024-point STFT, hop 256."""
    import torchaudio.functional as AF

    ref = reference.detach().double().cpu().reshape(-1, reference.shape[-1])
    est = estimate.detach().double().cpu().reshape(-1, estimate.shape[-1])
    n_fft = 1024 if ref.shape[-1] >= 1024 else 1 << max(4, (ref.shape[-1].bit_length() - 1))
    window = torch.hann_window(n_fft, dtype=torch.float64)
    fb = AF.melscale_fbanks(n_fft // 2 + 1, 0.0, sampling_rate / 2, n_mels, sampling_rate).double()

    def log_mel(x: Tensor) -> Tensor:
        spec = torch.stft(x, n_fft, hop_length=n_fft // 4, window=window, return_complex=True).abs().pow(2)
        return 10 * torch.log10((spec.transpose(-1, -2) @ fb).clamp_min(1e-10))

    return (log_mel(est) - log_mel(ref)).abs().mean().item()


def decode_with_noise(model: nn.Module, codes: list[Tensor], seed: int, device: torch.device,
                      decode: Callable[[list[Tensor]], Tensor] | None = None) -> Tensor:
    """Decode with ``model`` on ``device``, noise from a CPU generator; returns float32 audio on CPU.
    decode: called instead of ``model.decode`` (e.g. a ``torch.compile`` of it)."""
    with torch.inference_mode(), seeded_noise(model, seed, "cpu"):
        out = (decode or model.decode)([c.to(device) for c in codes])
    return out.float().cpu()


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _decode_original(factory, codes, seed, device, dtype) -> Tensor:
    model = factory()
    to_device_dtype(model, device, dtype)
    try:
        with true_float32() if dtype == torch.float32 else contextlib.nullcontext():
            return decode_with_noise(model, codes, seed, device)
    finally:
        del model
        _release(device)


def compare(
    fast,
    reference: nn.Module | None = None,
    codes: list[Tensor] | None = None,
    *,
    seed: int = 0,
    baseline: bool = True,
    reference_device: torch.device | str | None = None,
) -> FidelityReport:
    """Decode ``codes`` with ``fast`` (a FastSNAC) and with the original upstream model.

    reference: an upstream ``snac.SNAC`` with the same weights; None builds a fresh one from the
    fast model's source. It is run in float32 on ``reference_device`` (default: the fast model's)
    and left on the device it came from. baseline: also decode with plain upstream in the fast
    dtype (float16/bfloat16 only), and require the fast SNR to be within 0.2 dB of it.
    """
    if codes is None:
        raise ValueError("compare needs codes to decode")
    codes = [c.cpu() for c in validate_codes(codes, fast.config)]
    ref_device = torch.device(reference_device) if reference_device is not None else fast.device
    if reference is None:
        factory = fast.reference_model
    else:  # a CPU copy of its weights: the user's model is left where and as it is
        state = {k: v.detach().cpu() for k, v in reference.state_dict().items()}
        snapshot = Checkpoint.in_memory("reference model", fast.config, state)

        def factory():
            return build_upstream(snapshot)

    out_fast = fast.decode(codes, generator=torch.Generator().manual_seed(seed)).float().cpu()  # graphs too
    _release(fast.device)
    out_ref = _decode_original(factory, codes, seed, ref_device, torch.float32)
    baseline_snr = None
    if baseline and fast.dtype != torch.float32:  # in float32 the baseline is the reference itself
        out_base = _decode_original(factory, codes, seed, fast.device, fast.dtype)
        baseline_snr = snr_db(out_ref, out_base)

    report = FidelityReport(
        snr_db=snr_db(out_ref, out_fast),
        max_abs_error=max_abs_error(out_ref, out_fast),
        rms_fast=rms(out_fast),
        rms_reference=rms(out_ref),
        log_mel_distance_db=log_mel_distance_db(out_ref, out_fast, int(fast.config["sampling_rate"])),
        baseline_snr_db=baseline_snr,
        fast_dtype=str(fast.dtype).replace("torch.", ""),
        fast_device=str(fast.device),
        reference_dtype="float32",
        reference_device=str(ref_device),
        seed=seed,
        samples=out_fast.shape[-1],
    )
    judge(report, fast.dtype)
    return report


def judge(report: FidelityReport, dtype: torch.dtype) -> None:
    """Fill thresholds and failures: SNR >= max(floor, baseline - margin), log-mel within limit."""
    need = SNR_FLOOR_DB[dtype]
    if dtype != torch.float32 and report.baseline_snr_db is not None and math.isfinite(report.baseline_snr_db):
        need = max(need, report.baseline_snr_db - BASELINE_MARGIN_DB)
    report.thresholds = {"min_snr_db": need, "snr_floor_db": SNR_FLOOR_DB[dtype],
                         "baseline_margin_db": BASELINE_MARGIN_DB, "max_log_mel_db": LOG_MEL_LIMIT_DB[dtype]}
    report.failures = []
    if not math.isfinite(report.max_abs_error) or math.isnan(report.snr_db):
        report.failures.append("non-finite output")
    elif report.snr_db < need:
        report.failures.append(f"SNR {report.snr_db:.2f} dB < {need:.2f} dB")
    if not report.log_mel_distance_db <= LOG_MEL_LIMIT_DB[dtype]:
        report.failures.append(f"log-mel distance {report.log_mel_distance_db:.4f} dB > {LOG_MEL_LIMIT_DB[dtype]} dB")
