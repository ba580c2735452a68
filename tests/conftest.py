"""Test set-up: without CUDA, kernels run through Triton's interpreter (set before snac_fast imports)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n: a core per worker (two threads each oversubscribe the CPU)
    torch.set_num_threads(1)

import pytest  # noqa: E402

from snac_fast.fidelity import true_float32  # noqa: E402


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: "heavy" not in item.keywords)  # stable; pytest -n then spreads them first
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda")


@pytest.fixture
def no_tf32():
    """float32 GEMMs and convolutions in full float32 (TF32 off) for the test, restored after it."""
    with true_float32():
        yield


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every torch.empty and Tensor.new_empty comes back full of NaN: a kernel that skips an output
    element fails."""
    def poisoned(make):
        def empty(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        return empty

    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned(torch.Tensor.new_empty))
