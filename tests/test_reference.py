"""Regression against samples/reference/: upstream snac's float32 CPU decode of the sample tokens.

These fail loudly when the synthetic checkpoints, the upstream package or our kernels drift.
Thresholds: FastSNAC fp32 on CPU reproduces the files at 124.6-125.8 dB SNR here and on the GPU
machine's CPU (README, "Fidelity"); changing one tensor by a relative 1e-4 (a Snake alpha, a conv
weight, a codebook row) drops that to 83-104 dB, a worse sine to ~50 dB. 110 dB and 3e-6 max error
sit between the two (GPU float32: 100 dB and 1e-5, its own rounding).
"""

import json
from pathlib import Path

import pytest
import soundfile
import torch
from helpers import PERTURBATIONS, perturb

from snac_fast import FastSNAC, load_tokens
from snac_fast.fidelity import decode_with_noise
from snac_fast.metrics import max_abs_error, snr_db
from snac_fast.model.synthetic import state_dict_fingerprint, synthetic_model

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "samples" / "reference"
MANIFEST = json.loads((REFERENCE / "manifest.json").read_text())
MIN_SNR_DB = 110.0
MAX_ABS_ERROR = 3e-6
CPU = torch.device("cpu")


def reference(name):
    entry = MANIFEST["files"][f"{name}.wav"]
    audio, rate = soundfile.read(str(REFERENCE / f"{name}.wav"), dtype="float32")
    assert rate == entry["sampling_rate"] and audio.size == entry["samples"]
    codes, model = load_tokens(ROOT / entry["tokens"])
    assert model == entry["model"]
    return torch.from_numpy(audio).view(1, 1, -1), codes, entry


def assert_matches(expected, got, what):
    snr, err = snr_db(expected, got), max_abs_error(expected, got)
    print(f"{what}: SNR {snr:.2f} dB, max abs error {err:.3g}")
    assert snr >= MIN_SNR_DB and err <= MAX_ABS_ERROR, f"{what} drifted from samples/reference: SNR {snr:.2f} dB, max error {err:.3g}"


@pytest.mark.parametrize("name", ["snac_24khz", "snac_32khz", "snac_44khz"])
def test_synthetic_checkpoint_and_upstream_unchanged(name):
    expected, codes, entry = reference(name)
    model = synthetic_model(name, seed=entry["checkpoint_seed"])
    assert state_dict_fingerprint(model.state_dict()) == pytest.approx(entry["checkpoint_fingerprint"], rel=1e-6), (
        "the seeded synthetic checkpoint changed (torch RNG or snac init drift): regenerate with scripts/make_reference.py")
    assert_matches(expected, decode_with_noise(model, codes, entry["noise_seed"], CPU), f"upstream snac {name}")


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["snac_24khz", "snac_32khz", "snac_44khz"])
def test_fast_decode_reproduces_reference(name):
    expected, codes, entry = reference(name)
    fast = FastSNAC(synthetic_model(name, seed=entry["checkpoint_seed"]), device="cpu", dtype=torch.float32)
    got = fast.decode(codes, generator=torch.Generator().manual_seed(entry["noise_seed"]))
    assert_matches(expected, got, f"snac-fast {name}")


@pytest.mark.parametrize("what", list(PERTURBATIONS) + ["the noise key"])
def test_a_drifted_kernel_is_caught(what):
    """The files reject a 1e-4 relative change in any one layer (far less than a real kernel bug)
    and noise drawn from the next seed: decoded by upstream itself, so the check alone is tested."""
    expected, codes, entry = reference("snac_24khz")
    model, seed = synthetic_model("snac_24khz", seed=entry["checkpoint_seed"]), entry["noise_seed"]
    if what in PERTURBATIONS:
        perturb(model, what, codes)
    else:
        seed += 1
    with pytest.raises(AssertionError, match="drifted"):
        assert_matches(expected, decode_with_noise(model, codes, seed, CPU), "perturbed")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["snac_24khz", "snac_32khz", "snac_44khz"])
def test_gpu_fp32_reproduces_reference(cuda, no_tf32, name):
    """On CUDA in float32 (TF32 off) the files are matched to float32 rounding, not bit for bit."""
    expected, codes, entry = reference(name)
    fast = FastSNAC(synthetic_model(name, seed=entry["checkpoint_seed"]), device=cuda, dtype=torch.float32)
    got = fast.decode(codes, generator=torch.Generator().manual_seed(entry["noise_seed"]))  # graphs too
    snr = snr_db(expected, got)
    error = max_abs_error(expected, got)
    print(f"GPU fp32 {name}: SNR {snr:.2f} dB, max abs error {error:.3g}")
    assert snr >= 100 and error <= 1e-5  # measured 123 dB; a 1e-4 error in one layer costs 86-104 dB
