"""Signal comparison metrics, computed in float64 on CPU."""

from __future__ import annotations

import math

from torch import Tensor


def _pair(reference: Tensor, estimate: Tensor) -> tuple[Tensor, Tensor]:
    if reference.shape != estimate.shape:
        raise ValueError(f"shapes differ: reference {tuple(reference.shape)} vs estimate {tuple(estimate.shape)}")
    return reference.detach().double().cpu(), estimate.detach().double().cpu()


def snr_db(reference: Tensor, estimate: Tensor) -> float:
    """10 log10(sum ref^2 / sum (est - ref)^2) over all elements; inf when identical, nan on NaN."""
    ref, est = _pair(reference, estimate)
    noise = (est - ref).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    if math.isnan(noise) or math.isnan(signal):
        return math.nan
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


def max_abs_error(reference: Tensor, estimate: Tensor) -> float:
    ref, est = _pair(reference, estimate)
    return (est - ref).abs().max().item() if ref.numel() else 0.0


def rms(x: Tensor) -> float:
    return x.detach().double().cpu().pow(2).mean().sqrt().item() if x.numel() else 0.0
