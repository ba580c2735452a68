"""ops/noise: the keyed normal noise kernel against its reference, a function of the absolute position."""

import pytest
import torch

from snac_fast.ops.noise import keyed_normal, keyed_normal_reference


def test_keyed_noise_kernel_matches_reference_and_is_positional():
    seeds = torch.tensor([0, 2**62 + 12345, -7], dtype=torch.int64)
    rows, frames = torch.tensor([0, 1, 5]), torch.tensor([0, 3, -2])
    got = keyed_normal(seeds, rows, frames, 2048, -100, 3000, 2)
    want = keyed_normal_reference(seeds, rows, frames, 2048, -100, 3000, 2)
    assert got.shape == (3, 1, 3000) and (got - want).abs().max().item() < 1e-5
    later = keyed_normal(seeds, rows, frames + 1, 2048, -100, 3000, 2)
    assert torch.equal(got[..., 2048:], later[..., :3000 - 2048])  # a function of the absolute position
    for other in (keyed_normal(seeds, rows, frames, 2048, -100, 3000, 3), keyed_normal(seeds, rows + 1, frames, 2048, -100, 3000, 2),
                  keyed_normal(seeds + 1, rows, frames, 2048, -100, 3000, 2)):
        assert (got - other).abs().mean() > 0.5  # block, row and seed each give other noise
    big = keyed_normal(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 0, 0, 200_000, 0)
    assert abs(big.mean().item()) < 0.01 and abs(big.std().item() - 1) < 0.01
    out = torch.full((3, 1, 3000), float("nan"), dtype=torch.float16)
    keyed_normal(seeds, rows, frames, 2048, -100, 3000, 2, out=out)
    assert torch.isfinite(out).all() and (out.float() - want).abs().max() < 4e-3
    with pytest.raises(ValueError, match="int64"):
        keyed_normal(seeds.int(), rows, frames, 1, 0, 10, 0)
