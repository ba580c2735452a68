"""Offline checkpoints: seeded, untrained SNAC weights in the exact hub layout.

The audio such a model makes is noise-like (the weights are untrained), but its architecture, shapes
and arithmetic are the published models', so timing and fidelity figures measured on it are real.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import torch

from snac_fast.configs import published_config

SYNTHETIC_PREFIX = "synthetic:"
ALPHA_RANGE = (0.2, 5.0)  # Snake alphas drawn log-uniformly: trained models' alphas are not all 1


def synthetic_model(model: str = "snac_24khz", seed: int = 0, **overrides):
    """An upstream ``snac.SNAC`` (float32, CPU, eval) with seeded weights; ``model`` is a published
    name ("snac_24khz", "snac_32khz", "snac_44khz", or the hub id). ``overrides`` change config
    entries, e.g. ``decoder_dim=256, encoder_dim=16`` for a narrow model of the same structure
    (strides, attention windows, receptive field) that tests run faster."""
    import snac
    from snac.layers import Snake1d

    config = {**published_config(model), **overrides}
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(seed)
        net = snac.SNAC(**config)
    gen = torch.Generator().manual_seed(seed + 1)
    lo, hi = math.log(ALPHA_RANGE[0]), math.log(ALPHA_RANGE[1])
    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, Snake1d):
                module.alpha.copy_(torch.empty(module.alpha.shape).uniform_(lo, hi, generator=gen).exp())
    return net.eval()


def make_checkpoint(folder: str | Path, model: str = "snac_24khz", seed: int = 0, **overrides) -> Path:
    """Write config.json + pytorch_model.bin for a seeded synthetic model (``overrides`` as in
    :func:`synthetic_model`) into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    net = synthetic_model(model, seed, **overrides)
    (folder / "config.json").write_text(json.dumps({**published_config(model), **overrides}, indent=2) + "\n")
    torch.save(net.state_dict(), folder / "pytorch_model.bin")
    return folder


def fill_hub_cache(cache_dir: str | Path, repo_id: str, folder: str | Path, commit: str = "0" * 40) -> Path:
    """Lay ``folder``'s files out as huggingface_hub's cache does for ``repo_id`` at revision main,
    so that ``hf_hub_download(..., cache_dir=cache_dir)`` finds them offline. Returns the snapshot."""
    repo_dir = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    for f in Path(folder).iterdir():
        shutil.copy2(f, snapshot / f.name)
    return snapshot


def state_dict_sha256(state: dict) -> str:
    """Hash of a state dict's names, shapes, dtypes and values (independent of file format)."""
    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key].detach().cpu().contiguous()
        h.update(f"{key}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def state_dict_fingerprint(state: dict) -> list[float]:
    """[sum |x|, sum x^2] over all floating tensors, in float64. Unlike the sha256, it survives the
    last-bit differences between CPUs (weight-norm magnitudes come from a SIMD-width-dependent
    reduction); any real change of the weights moves it far beyond 1e-6 relative."""
    abs_sum = sq_sum = 0.0
    for t in state.values():
        if t.dtype.is_floating_point:
            d = t.detach().double()
            abs_sum += d.abs().sum().item()
            sq_sum += d.pow(2).sum().item()
    return [abs_sum, sq_sum]


def speech_like(seconds: float, rate: int, seed: int = 0):
    """A voiced-speech stand-in as float32 numpy [seconds * rate]: a gliding harmonic tone (f0 from
    90-220 Hz) under a syllable-rate envelope, plus a little noise. Deterministic per seed."""
    import numpy as np

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = rng.uniform(90, 220) + 30 * np.sin(2 * np.pi * rng.uniform(0.3, 1.0) * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(3, 5) * t) ** 2
    return (0.2 * voice * envelope + 0.01 * rng.standard_normal(t.size)).astype(np.float32)

