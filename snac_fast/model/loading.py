"""Find, read and check SNAC checkpoints: hub ids (through huggingface_hub), local folders, and
``synthetic:<model>`` (seeded weights built in memory, see :mod:`snac_fast.model.synthetic`)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # preference order


class CheckpointError(ValueError):
    """A checkpoint could not be found, read, or does not match its config. The message says what to do."""


@dataclass
class Checkpoint:
    """A resolved checkpoint: its config (the config.json dict) and a way to read its weights."""

    source: str  # what the user named: hub id, folder, or synthetic:<model>
    config: dict
    load_state_dict: Callable[[], dict]  # re-readable, so a reference copy can be rebuilt later
    weights_path: str | None = None
    build_model: Callable[[], "torch.nn.Module"] | None = None  # builds the weights in place (synthetic)

    @classmethod
    def in_memory(cls, source: str, config: dict, state: dict) -> "Checkpoint":
        """A checkpoint over a state dict already in memory (kept on CPU by the caller)."""
        return cls(source, config, lambda: state)


def _read_config(path: str | Path, source: str) -> dict:
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {CONFIG_FILE} of {source!r} ({path}): {e}") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{CONFIG_FILE} of {source!r} is not a JSON object")
    return config


def read_weights(path: str | Path) -> dict:
    """State dict from model.safetensors or pytorch_model.bin (``weights_only=True``), on CPU."""
    path = str(path)
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path, device="cpu")
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch/pickle/safetensors raise many types for a truncated or foreign file
        raise CheckpointError(f"cannot read weights {path}: corrupt or not a SNAC checkpoint ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"weights {path} do not hold a state dict of tensors")
    return state


def _from_folder(folder: Path) -> Checkpoint:
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"folder {str(folder)!r} has no {CONFIG_FILE}; a SNAC checkpoint folder holds {CONFIG_FILE} and one of {', '.join(WEIGHT_FILES)}")
    weights = next((folder / f for f in WEIGHT_FILES if (folder / f).is_file()), None)
    if weights is None:
        raise CheckpointError(f"folder {str(folder)!r} has no weights: expected one of {', '.join(WEIGHT_FILES)}")
    return Checkpoint(str(folder), _read_config(config_path, str(folder)), lambda: read_weights(weights), str(weights))


HUB_PROBE_SECONDS = 2.0


def hub_reachable(timeout: float = HUB_PROBE_SECONDS) -> bool:
    """Whether a TCP connection to the hub's endpoint (``HF_ENDPOINT``) opens within ``timeout``
    seconds. Behind a proxy (``HTTPS_PROXY``, ``ALL_PROXY``) it answers True without trying: the
    proxy, not a direct connection, decides. huggingface_hub itself retries an unreachable host five
    times with backoff (~25 s before its error), which an offline user should not wait for."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlsplit(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=timeout):
            return True
    except OSError:
        return False


def _from_hub(repo_id: str, revision: str | None, cache_dir: str | None, local_files_only: bool, token: str | bool | None) -> Checkpoint:
    from huggingface_hub import errors as hf_errors
    from huggingface_hub import hf_hub_download

    if not local_files_only and not hub_reachable():
        local_files_only = True  # the hub cache may still hold it; else the offline error below, at once

    def download(filename: str) -> str:
        return hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir,
                               local_files_only=local_files_only, token=token)

    offline_hint = (f"{repo_id!r} could not be downloaded (no network, HF_HUB_OFFLINE=1 or local_files_only) and "
                    "its files are not in the hub cache. Fetch it once where the network works "
                    f"(`hf download {repo_id}`), point cache_dir/HF_HUB_CACHE at that cache, or pass a local "
                    f"folder holding {CONFIG_FILE} and pytorch_model.bin")
    try:
        config_path = download(CONFIG_FILE)
    except hf_errors.LocalEntryNotFoundError as e:
        raise CheckpointError(offline_hint) from e
    except hf_errors.RepositoryNotFoundError as e:
        raise CheckpointError(f"{repo_id!r} is neither a local folder nor a repository on the Hub (private? pass token=)") from e
    except hf_errors.RevisionNotFoundError as e:
        raise CheckpointError(f"revision {revision!r} not found in {repo_id!r}") from e
    except hf_errors.EntryNotFoundError as e:
        raise CheckpointError(f"{repo_id!r} has no {CONFIG_FILE}: not a SNAC checkpoint") from e
    except hf_errors.HFValidationError as e:
        raise CheckpointError(f"{repo_id!r} is neither a local folder nor a valid hub repo id ({e})") from e
    weights = None
    for filename in WEIGHT_FILES:
        try:
            weights = download(filename)
            break
        except (hf_errors.EntryNotFoundError, hf_errors.LocalEntryNotFoundError):
            continue  # not in the repo, or not cached while offline: try the next format
    if weights is None:
        raise CheckpointError(f"{repo_id!r} has {CONFIG_FILE} but none of {', '.join(WEIGHT_FILES)} could be found; " + offline_hint)
    return Checkpoint(repo_id, _read_config(config_path, repo_id), lambda: read_weights(weights), weights)


def _synthetic(name: str) -> Checkpoint:
    from snac_fast.configs import published_config
    from snac_fast.model.synthetic import SYNTHETIC_PREFIX, synthetic_model

    model = name[len(SYNTHETIC_PREFIX):]
    try:
        config = published_config(model)
    except KeyError as e:
        raise CheckpointError(str(e.args[0])) from e
    return Checkpoint(name, config, lambda: synthetic_model(model).state_dict(),
                      build_model=lambda: synthetic_model(model))


def resolve_checkpoint(
    name_or_path: str | os.PathLike,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
) -> Checkpoint:
    """Locate a checkpoint: ``synthetic:<model>``, a local folder, else a hub repo id."""
    from snac_fast.model.synthetic import SYNTHETIC_PREFIX

    name = os.fspath(name_or_path)
    if name.startswith(SYNTHETIC_PREFIX):
        return _synthetic(name)
    path = Path(name).expanduser()
    if path.is_dir():
        return _from_folder(path)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise CheckpointError(f"{name!r} is not a folder; pass a folder holding {CONFIG_FILE} and the weights, or a hub repo id")
    return _from_hub(name, revision, None if cache_dir is None else os.fspath(cache_dir), local_files_only, token)


# torch.nn.init functions that module constructors call; skipped while a model whose every weight
# is loaded right after is built (a third of a second of random fills for snac_24khz)
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "zeros_", "ones_", "kaiming_uniform_",
                   "kaiming_normal_", "xavier_uniform_", "xavier_normal_")
_skip_init = threading.local()
_init_patch = {"lock": threading.Lock(), "users": 0, "saved": {}}


def _unless_skipped(original: Callable) -> Callable:
    @functools.wraps(original)
    def init(tensor, *args, **kwargs):
        return tensor if getattr(_skip_init, "on", False) else original(tensor, *args, **kwargs)
    return init


@contextlib.contextmanager
def _without_weight_init():
    """Module constructors on this thread leave their parameters uninitialised (the caller loads
    every one of them). Other threads, building modules meanwhile, still initialise theirs: the
    patched functions look at a thread-local flag."""
    import torch.nn.init as init

    with _init_patch["lock"]:
        if _init_patch["users"] == 0:
            _init_patch["saved"] = {name: getattr(init, name) for name in _INIT_FUNCTIONS}
            for name, original in _init_patch["saved"].items():
                setattr(init, name, _unless_skipped(original))
        _init_patch["users"] += 1
    _skip_init.on = True
    try:
        yield
    finally:
        _skip_init.on = False
        with _init_patch["lock"]:
            _init_patch["users"] -= 1
            if _init_patch["users"] == 0:
                for name, original in _init_patch["saved"].items():
                    setattr(init, name, original)


def build_upstream(checkpoint: Checkpoint, state_dict: dict | None = None):
    """The original ``snac.SNAC`` (float32, CPU, eval) of a checkpoint, weights loaded and checked
    (every parameter and persistent buffer comes from the checkpoint, so none is initialised).
    A synthetic checkpoint builds its seeded model once, weights and all."""
    import snac

    if state_dict is None and checkpoint.build_model is not None:
        return checkpoint.build_model().eval()

    try:
        with _without_weight_init():
            model = snac.SNAC(**checkpoint.config)
    except TypeError as e:
        raise CheckpointError(f"{CONFIG_FILE} of {checkpoint.source!r} does not fit snac.SNAC: {e}") from e
    state = checkpoint.load_state_dict() if state_dict is None else state_dict
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise CheckpointError(f"weights of {checkpoint.source!r} do not match its {CONFIG_FILE}: {e}") from e
    if result.missing_keys or result.unexpected_keys:
        def listing(keys):
            return ", ".join(keys[:8]) + (f" (+{len(keys) - 8} more)" if len(keys) > 8 else "")

        parts = []
        if result.missing_keys:
            parts.append(f"missing {len(result.missing_keys)}: {listing(result.missing_keys)}")
        if result.unexpected_keys:
            parts.append(f"unexpected {len(result.unexpected_keys)}: {listing(result.unexpected_keys)}")
        raise CheckpointError(f"weights of {checkpoint.source!r} do not match its {CONFIG_FILE}; " + "; ".join(parts))
    return model.eval()
