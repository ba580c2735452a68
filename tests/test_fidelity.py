"""Fidelity metrics and report logic, identical-noise plumbing, and the GPU fidelity matrix."""

import math

import pytest
import torch
from helpers import NARROW, random_codes

from snac_fast import FastSNAC
from snac_fast.fidelity import (
    FidelityReport,
    decode_with_noise,
    judge,
    log_mel_distance_db,
)
from snac_fast.metrics import max_abs_error, rms, snr_db
from snac_fast.model.synthetic import synthetic_model


def test_snr_and_errors_on_known_signals():
    t = torch.arange(48000, dtype=torch.float64) / 48000
    ref = torch.sin(2 * torch.pi * 440 * t)
    noise = 1e-3 * torch.sign(torch.sin(2 * torch.pi * 7 * t + 0.1))  # |noise| = 1e-3 everywhere
    assert snr_db(ref, ref.float()) > 140
    assert snr_db(ref, ref) == math.inf
    expected = 10 * math.log10(ref.pow(2).sum().item() / noise.pow(2).sum().item())
    assert snr_db(ref, ref + noise) == pytest.approx(expected, abs=1e-9)
    assert expected == pytest.approx(10 * math.log10(0.5 / 1e-6), abs=0.01)  # sine power 1/2
    assert max_abs_error(ref, ref + noise) == pytest.approx(1e-3)
    assert rms(ref) == pytest.approx(math.sqrt(0.5), rel=1e-6)
    assert math.isnan(snr_db(ref, ref * float("nan")))
    with pytest.raises(ValueError, match="shapes differ"):
        snr_db(ref, ref[:-1])


def test_log_mel_distance():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 24000, generator=gen)
    assert log_mel_distance_db(x, x, 24000) == 0.0
    assert log_mel_distance_db(x, 2 * x, 24000) == pytest.approx(10 * math.log10(4), abs=1e-6)  # power x4
    assert log_mel_distance_db(x, x + 1e-3 * torch.randn(x.shape, generator=gen), 24000) < 0.01


def report(snr, baseline=None, log_mel=0.0, err=1e-3):
    return FidelityReport(snr_db=snr, max_abs_error=err, rms_fast=0.1, rms_reference=0.1, log_mel_distance_db=log_mel,
                          baseline_snr_db=baseline, fast_dtype="x", fast_device="cpu", reference_dtype="float32",
                          reference_device="cpu", seed=0, samples=10)


def test_pass_fail_logic():
    r = report(56.0)
    judge(r, torch.float32)
    assert r.passed and r.thresholds["min_snr_db"] == 55.0
    r = report(45.0)
    judge(r, torch.float32)
    assert not r.passed and "SNR" in r.failures[0]
    r = report(57.0, baseline=57.1)  # fp16 within 0.2 dB of plain upstream fp16: pass
    judge(r, torch.float16)
    assert r.passed and r.thresholds["min_snr_db"] == pytest.approx(56.9)
    r = report(56.8, baseline=57.1)  # 0.3 dB worse than plain fp16: fail even far above the floor
    judge(r, torch.float16)
    assert not r.passed
    r = report(51.0)  # no baseline run: the floor alone
    judge(r, torch.float16)
    assert r.passed
    r = report(49.0)
    judge(r, torch.float16)
    assert not r.passed
    r = report(130.0, baseline=math.inf)  # float32 ignores the baseline
    judge(r, torch.float32)
    assert r.passed
    r = report(60.0, log_mel=1.0)
    judge(r, torch.float16)
    assert not r.passed and "log-mel" in r.failures[0]
    r = report(float("nan"), err=float("nan"))
    judge(r, torch.float32)
    assert not r.passed and "non-finite" in r.failures[0]
    assert '"passed": false' in r.to_json() and "FAIL" in str(r)


@pytest.fixture(scope="module")
def fast24():  # the check's logic, not the model's widths, is under test here
    return FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu")


def test_check_fidelity_passes_in_float32(fast24):
    codes = random_codes(fast24.config, 2, batch=2, seed=3)
    r = fast24.check_fidelity(codes, seed=0)
    assert r.passed, str(r)
    assert r.snr_db > 100 and r.samples == 4096 and r.fast_dtype == "float32" and r.baseline_snr_db is None
    assert r.rms_fast == pytest.approx(r.rms_reference, rel=1e-5) and r.rms_fast > 0.01
    assert fast24.check_fidelity(codes, seed=0).snr_db == r.snr_db  # reproducible


def test_half_precision_check_runs_the_plain_upstream_baseline():
    """The baseline path on CPU: a float16 codec is also compared with plain upstream decoded in
    float16, and must come within 0.2 dB of it; snac-fast (float32 accumulation) beats it.
    (Not bfloat16 here: Triton's interpreter rounds float32 to bfloat16 toward zero, twice the
    GPU's round-to-nearest error, so its bfloat16 kernels are not the GPU's arithmetic;
    test_gpu_fidelity_matrix runs that baseline on the GPU.)"""
    dtype = torch.float16
    fast = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu", dtype=dtype)
    codes = random_codes(fast.config, 2, batch=2, seed=3)
    r = fast.check_fidelity(codes, seed=0)
    assert r.fast_dtype == str(dtype).replace("torch.", "") and r.baseline_snr_db is not None
    assert 25 < r.baseline_snr_db < 80  # plain upstream in half precision: far from float32's 120+ dB
    assert r.thresholds["min_snr_db"] == max(r.thresholds["snr_floor_db"], r.baseline_snr_db - 0.2)
    assert r.passed and r.snr_db > r.baseline_snr_db, str(r)
    assert fast.check_fidelity(codes, seed=0, baseline=False).baseline_snr_db is None


def test_different_noise_fails_the_check(fast24):
    """The check is only meaningful with identical noise: a deliberately different seed must fail."""
    codes = random_codes(fast24.config, 2, seed=3)
    fast_out = decode_with_noise(fast24.model, codes, 0, fast24.device)
    ref_out = decode_with_noise(fast24.reference_model(), codes, 1, fast24.device)
    r = report(snr_db(ref_out, fast_out), log_mel=log_mel_distance_db(ref_out, fast_out, 24000))
    judge(r, torch.float32)
    assert not r.passed and r.snr_db < 30


def test_check_leaves_user_reference_alone(fast24):
    from snac_fast.fidelity import compare

    ref = fast24.reference_model()
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    r = compare(fast24, ref, random_codes(fast24.config, 2, seed=1), seed=2)
    assert r.passed
    after = ref.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match="3 code levels"):
        compare(fast24, None, random_codes(fast24.config, 2)[:2])


GPU_FIGURES = []


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["snac_24khz", "snac_32khz", "snac_44khz"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 3])
def test_gpu_fidelity_matrix(cuda, name, dtype, batch):
    fast = FastSNAC.from_pretrained(f"synthetic:{name}", device=cuda, dtype=dtype)
    codes = random_codes(fast.config, 16, batch=batch, seed=batch)
    fast.check_fidelity(codes, seed=0)  # first: captures this shape's graph, allocates cuBLAS workspaces
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    r = fast.check_fidelity(codes, seed=0)
    assert torch.cuda.memory_allocated() <= allocated + 1024 * 1024, "the reference copy stayed on the GPU"
    base = f"{r.baseline_snr_db:.2f}" if r.baseline_snr_db is not None else "-"
    print(f"\nFIDELITY {name} {r.fast_dtype} B={batch}: SNR {r.snr_db:.2f} dB (plain upstream {base}), "
          f"max err {r.max_abs_error:.3g}, log-mel {r.log_mel_distance_db:.4f} dB, {'PASS' if r.passed else 'FAIL'}")
    assert r.passed, str(r)
