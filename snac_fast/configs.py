"""The three published SNAC models: hub ids and configs (the hub's config.json contents)."""

from __future__ import annotations

import copy

DEFAULT_MODEL = "hubertsiuzdak/snac_24khz"

_24KHZ = {
    "sampling_rate": 24000, "encoder_dim": 48, "encoder_rates": [2, 4, 8, 8], "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2], "attn_window_size": None, "codebook_size": 4096, "codebook_dim": 8,
    "vq_strides": [4, 2, 1], "noise": True, "depthwise": True,
}
_32KHZ = {
    "sampling_rate": 32000, "encoder_dim": 64, "encoder_rates": [2, 3, 8, 8], "decoder_dim": 1536,
    "decoder_rates": [8, 8, 3, 2], "attn_window_size": 32, "codebook_size": 4096, "codebook_dim": 8,
    "vq_strides": [8, 4, 2, 1], "noise": True, "depthwise": True,
}
PUBLISHED_CONFIGS: dict[str, dict] = {
    "hubertsiuzdak/snac_24khz": _24KHZ,
    "hubertsiuzdak/snac_32khz": _32KHZ,
    "hubertsiuzdak/snac_44khz": {**_32KHZ, "sampling_rate": 44100},
}


def published_config(name: str) -> dict:
    """Config of a published model by hub id or short name ("snac_24khz"); KeyError lists the names."""
    repo_id = name if "/" in name else f"hubertsiuzdak/{name}"
    if repo_id not in PUBLISHED_CONFIGS:
        names = ", ".join(k.split("/")[1] for k in PUBLISHED_CONFIGS)
        raise KeyError(f"unknown SNAC model {name!r}; published ones: {names}")
    return copy.deepcopy(PUBLISHED_CONFIGS[repo_id])
