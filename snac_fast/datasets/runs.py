"""What every run shares: the codec it loads, its model's name, its progress bar."""

from __future__ import annotations

from snac_fast.configs import DEFAULT_MODEL


def _model_name(codec) -> str:
    return codec.source or "in-memory model"


def _load(model: str | None, device: str | None = None, dtype: str | None = None, **options):
    from snac_fast.api import FastSNAC

    return FastSNAC.from_pretrained(model or DEFAULT_MODEL, device=device, dtype=dtype, **options)


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="file", disable=not enabled or None, dynamic_ncols=True)
