"""Checkpoint loading: local folders, a pre-filled hub cache offline, and every error path."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import PERTURBATIONS, perturb, random_codes

from snac_fast import CheckpointError, FastSNAC
from snac_fast.configs import published_config
from snac_fast.model.synthetic import (
    fill_hub_cache,
    make_checkpoint,
    state_dict_sha256,
    synthetic_model,
)

REPO = "hubertsiuzdak/snac_24khz"


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "snac_24khz", "snac_24khz", seed=0)


def weights_digest(fast) -> str:
    """Every tensor of the model after surgery (names, shapes, bytes): a wrongly loaded conv changes it."""
    return state_dict_sha256(fast.model.state_dict())


def same_weights(a, b) -> bool:
    return weights_digest(a) == weights_digest(b)


def test_make_checkpoint_hub_layout(checkpoint_dir):
    assert sorted(p.name for p in checkpoint_dir.iterdir()) == ["config.json", "pytorch_model.bin"]
    config = json.loads((checkpoint_dir / "config.json").read_text())
    assert config["decoder_rates"] == [8, 8, 4, 2] and config["vq_strides"] == [4, 2, 1]
    alphas = torch.cat([v.flatten() for k, v in torch.load(checkpoint_dir / "pytorch_model.bin", weights_only=True).items() if k.endswith("alpha")])
    assert 0.2 <= alphas.min() and alphas.max() <= 5.0 and alphas.std() > 0.5


def test_load_from_folder_matches_seeded_weights(checkpoint_dir):
    fast = FastSNAC.from_pretrained(checkpoint_dir, device="cpu")
    assert same_weights(fast, FastSNAC(synthetic_model("snac_24khz", seed=0), device="cpu"))
    assert fast.source == str(checkpoint_dir)
    other = make_checkpoint(checkpoint_dir.parent / "seed1", "snac_24khz", seed=1)
    assert not same_weights(FastSNAC.from_pretrained(str(other), device="cpu"), fast)


def test_load_safetensors_folder(tmp_path, checkpoint_dir):
    from safetensors.torch import save_file

    state = torch.load(checkpoint_dir / "pytorch_model.bin", weights_only=True)
    (tmp_path / "config.json").write_text((checkpoint_dir / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    fast = FastSNAC.from_pretrained(tmp_path, device="cpu")
    assert same_weights(fast, FastSNAC.from_pretrained(checkpoint_dir, device="cpu"))


def test_legacy_weight_norm_keys_load(tmp_path, checkpoint_dir):
    """Checkpoints saved with the old weight_norm (weight_g / weight_v) load through torch's hook."""
    state = torch.load(checkpoint_dir / "pytorch_model.bin", weights_only=True)
    legacy = {k.replace("parametrizations.weight.original0", "weight_g").replace("parametrizations.weight.original1", "weight_v"): v
              for k, v in state.items()}
    assert any(k.endswith("weight_g") for k in legacy)
    (tmp_path / "config.json").write_text((checkpoint_dir / "config.json").read_text())
    torch.save(legacy, tmp_path / "pytorch_model.bin")
    assert same_weights(FastSNAC.from_pretrained(tmp_path, device="cpu"), FastSNAC.from_pretrained(checkpoint_dir, device="cpu"))
    broken = dict(legacy)
    key = next(k for k in broken if k.endswith("weight_v"))
    broken[key] = broken[key] * 1.0001 + 1e-4  # a conv loaded a little wrong must not pass
    torch.save(broken, tmp_path / "pytorch_model.bin")
    assert not same_weights(FastSNAC.from_pretrained(tmp_path, device="cpu"), FastSNAC.from_pretrained(checkpoint_dir, device="cpu"))


@pytest.mark.parametrize("what", list(PERTURBATIONS))
def test_loading_check_rejects_a_small_error(tmp_path, checkpoint_dir, what):
    """A checkpoint with one tensor off by 1e-4 (the mutation tests' errors) loads to other weights."""
    model = synthetic_model("snac_24khz", seed=0)
    perturb(model, what, random_codes(published_config("snac_24khz"), 2, seed=0))
    (tmp_path / "config.json").write_text((checkpoint_dir / "config.json").read_text())
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    assert not same_weights(FastSNAC.from_pretrained(tmp_path, device="cpu"), FastSNAC.from_pretrained(checkpoint_dir, device="cpu"))


def run_python(code: str, env_extra: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_hub_cache_offline(tmp_path, checkpoint_dir):
    cache = tmp_path / "hub"
    fill_hub_cache(cache, REPO, checkpoint_dir)
    code = ("from snac_fast import FastSNAC; from snac_fast.model.synthetic import state_dict_sha256; "
            f"m = FastSNAC.from_pretrained({REPO!r}, device='cpu'); "
            "print(state_dict_sha256(m.model.state_dict()), m.source)")
    proc = run_python(code, {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home")})
    assert proc.returncode == 0, proc.stderr
    digest, source = proc.stdout.split()
    assert digest == weights_digest(FastSNAC.from_pretrained(checkpoint_dir, device="cpu")) and source == REPO


def test_hub_cache_via_cache_dir_argument(tmp_path, checkpoint_dir):
    fill_hub_cache(tmp_path / "hub", REPO, checkpoint_dir)
    fast = FastSNAC.from_pretrained(REPO, device="cpu", cache_dir=tmp_path / "hub", local_files_only=True)
    assert fast.source == REPO and fast.report.decoder_snakes


def test_offline_and_not_cached_says_what_to_do(tmp_path):
    with pytest.raises(CheckpointError, match=r"hubertsiuzdak/snac_24khz.*not in the hub cache.*local\s+folder"):
        FastSNAC.from_pretrained(REPO, device="cpu", cache_dir=tmp_path, local_files_only=True)
    proc = run_python(f"from snac_fast import FastSNAC; FastSNAC.from_pretrained({REPO!r}, device='cpu')",
                      {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HOME": str(tmp_path / "home")})
    assert proc.returncode != 0
    assert "CheckpointError" in proc.stderr and "local folder" in proc.stderr


def test_unreachable_hub_uses_the_cache_or_fails_at_once(tmp_path, checkpoint_dir):
    """No network (the endpoint refuses connections) and no HF_HUB_OFFLINE: a cached model loads from
    the cache, an uncached one fails with the offline hint, without huggingface_hub's five retries."""
    unreachable = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "home")}
    fill_hub_cache(tmp_path / "hub", REPO, checkpoint_dir)
    code = f"from snac_fast import FastSNAC; print(FastSNAC.from_pretrained({REPO!r}, device='cpu').source)"
    proc = run_python(code, {**unreachable, "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert proc.returncode == 0 and proc.stdout.split() == [REPO], proc.stderr
    proc = run_python(code, {**unreachable, "HF_HUB_CACHE": str(tmp_path / "empty")})
    assert proc.returncode != 0 and "not in the hub cache" in proc.stderr
    assert "Retrying" not in proc.stderr


def test_folder_errors(tmp_path, checkpoint_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        FastSNAC.from_pretrained(empty, device="cpu")
    (empty / "config.json").write_text((checkpoint_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no weights"):
        FastSNAC.from_pretrained(empty, device="cpu")
    (empty / "pytorch_model.bin").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="corrupt"):
        FastSNAC.from_pretrained(empty, device="cpu")
    (empty / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read config.json"):
        FastSNAC.from_pretrained(empty, device="cpu")
    with pytest.raises(CheckpointError, match="not a folder"):
        FastSNAC.from_pretrained(checkpoint_dir / "config.json", device="cpu")
    with pytest.raises(CheckpointError, match="not a folder"):
        FastSNAC.from_pretrained("./does/not/exist", device="cpu")


def test_state_dict_mismatches_are_listed(tmp_path, checkpoint_dir):
    state = torch.load(checkpoint_dir / "pytorch_model.bin", weights_only=True)
    dropped = sorted(state)[0]
    state.pop(dropped)
    state["decoder.extra.weight"] = torch.zeros(1)
    (tmp_path / "config.json").write_text((checkpoint_dir / "config.json").read_text())
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=rf"missing 1: {dropped}.*unexpected 1: decoder.extra.weight"):
        FastSNAC.from_pretrained(tmp_path, device="cpu")


def test_config_that_does_not_fit(tmp_path, checkpoint_dir):
    config = json.loads((checkpoint_dir / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").symlink_to(checkpoint_dir / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps({**config, "decoder_dim": 512}))
    with pytest.raises(CheckpointError, match="do not match"):
        FastSNAC.from_pretrained(tmp_path, device="cpu")
    (tmp_path / "config.json").write_text(json.dumps({**config, "bogus_option": 1}))
    with pytest.raises(CheckpointError, match="bogus_option"):
        FastSNAC.from_pretrained(tmp_path, device="cpu")


def test_unknown_synthetic_model():
    with pytest.raises(CheckpointError, match="snac_24khz, snac_32khz, snac_44khz"):
        FastSNAC.from_pretrained("synthetic:snac_16khz", device="cpu")


def test_weights_only_refuses_pickled_code(tmp_path, checkpoint_dir):
    class Evil:
        def __reduce__(self):
            return (print, ("executed",))

    (tmp_path / "config.json").write_text((checkpoint_dir / "config.json").read_text())
    torch.save({"x": Evil()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="corrupt or not a SNAC checkpoint"):
        FastSNAC.from_pretrained(Path(tmp_path), device="cpu")


def test_built_model_takes_every_tensor_from_the_checkpoint():
    """build_upstream skips weight init (every weight is loaded right after): all parameters and
    buffers, the attention's non-persistent ones included, equal those of the seeded model."""
    from snac_fast.model.loading import Checkpoint, build_upstream

    overrides = {"decoder_dim": 64, "encoder_dim": 8}
    source = synthetic_model("snac_32khz", seed=3, **overrides)
    config = _config_of("snac_32khz", overrides)
    built = build_upstream(Checkpoint.in_memory("seeded", config, source.state_dict()))
    expected = {**dict(source.named_parameters()), **dict(source.named_buffers())}
    got = {**dict(built.named_parameters()), **dict(built.named_buffers())}
    assert got.keys() == expected.keys() and any("scale" in k for k in got)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_synthetic_checkpoint_builds_its_seeded_model_once():
    """A synthetic checkpoint's model is built with its seeded weights (no empty build plus load),
    equal to the weights a folder written from it holds."""
    from snac_fast.model.loading import build_upstream, resolve_checkpoint

    checkpoint = resolve_checkpoint("synthetic:snac_24khz")
    built, state = build_upstream(checkpoint), checkpoint.load_state_dict()
    assert built.state_dict().keys() == state.keys() and not built.training
    for name, tensor in state.items():
        assert torch.equal(built.state_dict()[name], tensor), name


def test_from_pretrained_takes_a_resolved_checkpoint():
    """A Checkpoint that resolve_checkpoint found loads as its name would, without a second lookup;
    options that locate a checkpoint are refused beside one."""
    from snac_fast.model.loading import resolve_checkpoint

    checkpoint = resolve_checkpoint("synthetic:snac_24khz")
    by_checkpoint = FastSNAC.from_pretrained(checkpoint, device="cpu", fuse=False, accelerate_encoder=False)
    by_name = FastSNAC.from_pretrained("synthetic:snac_24khz", device="cpu", fuse=False, accelerate_encoder=False)
    assert by_checkpoint.source == by_name.source == "synthetic:snac_24khz"
    assert by_checkpoint.config == by_name.config
    for (name, a), (_, b) in zip(by_checkpoint.model.state_dict().items(), by_name.model.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="resolve_checkpoint"):
        FastSNAC.from_pretrained(checkpoint, device="cpu", revision="main")


def _config_of(model, overrides):
    from snac_fast.configs import published_config

    return {**published_config(model), **overrides}


def test_weight_init_is_skipped_on_the_building_thread_only():
    import threading

    import torch.nn.init as init

    from snac_fast.model.loading import _without_weight_init

    original = init.uniform_
    seen = {}

    def other_thread():
        torch.manual_seed(5)
        seen["other"] = torch.nn.Linear(8, 8).weight.detach().clone()

    torch.manual_seed(5)
    expected = torch.nn.Linear(8, 8).weight.detach().clone()
    with _without_weight_init():
        assert init.uniform_ is not original
        marker = torch.full((4,), 7.0)
        assert torch.equal(init.uniform_(marker), torch.full((4,), 7.0))  # skipped here
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
    assert init.uniform_ is original
    assert torch.equal(seen["other"], expected)
    assert not torch.equal(init.uniform_(torch.full((4,), 7.0)), torch.full((4,), 7.0))
