"""What every run shares: the codec it loads, its model's name, its progress bar."""

from __future__ import annotations

from snac_fast.configs import DEFAULT_MODEL

# the options of FastSNAC.from_pretrained that say where its checkpoint is
HUB_OPTIONS = ("revision", "cache_dir", "local_files_only", "token")


def model_name(codec) -> str:
    return codec.source or "in-memory model"


def load_codec(model, device: str | None = None, dtype: str | None = None, **options):
    """``FastSNAC.from_pretrained`` of ``model`` (a name, default the default model, or a
    :class:`snac_fast.loading.Checkpoint` already found: the hub options are then left out)."""
    from snac_fast.api import FastSNAC
    from snac_fast.loading import Checkpoint

    if isinstance(model, Checkpoint):
        options = {k: v for k, v in options.items() if k not in HUB_OPTIONS}
    return FastSNAC.from_pretrained(model or DEFAULT_MODEL, device=device, dtype=dtype, **options)


def find_checkpoint(load: dict):
    """The checkpoint ``load_codec(**load)`` will load (its config, its source's name), found without
    building the model."""
    from snac_fast.loading import resolve_checkpoint

    return resolve_checkpoint(load["model"] or DEFAULT_MODEL, **{k: v for k, v in load.items() if k in HUB_OPTIONS})


def progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="file", disable=not enabled or None, dynamic_ncols=True)
