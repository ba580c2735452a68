"""The streaming stage's context kernel against its torch reference (Triton interpreter on CPU)."""

import pytest
import torch

from snac_fast.ops.context import context_step, context_step_reference


@pytest.mark.parametrize("C,H,N,channels_last", [(5, 3, 4, False), (33, 22, 2, True), (7, 6, 300, False),
                                                 (40, 130, 1, True), (3, 12, 12, False),
                                                 (4, 300, 5, False), (6, 20, 600, True)])
def test_context_step_matches_reference(C, H, N, channels_last):
    """Contexts within the first tile (its program alone rewrites them while the other tiles run in
    parallel) and longer ones (one program walks every tile), N below, at and above H."""
    gen = torch.Generator().manual_seed(C * H + N)
    state = torch.randn(6, C, H, generator=gen)
    slots = torch.tensor([4, 0, 2], dtype=torch.int64)
    new = torch.randn(3, N, C, generator=gen).transpose(1, 2) if channels_last else torch.randn(3, C, N, generator=gen)
    expected_state = state.clone()
    expected = context_step_reference(expected_state, slots, new, torch.full((3, C, H + N), float("nan")))
    got = context_step(state, slots, new, channels_last=channels_last)
    assert got.shape == (3, C, H + N)
    assert (got.stride(1) == 1) == channels_last
    assert torch.equal(got, expected)
    assert torch.equal(state, expected_state)  # untouched rows 1, 3, 5 too
    assert torch.equal(state[2, :, :max(H - N, 0)], expected_state[2, :, :max(H - N, 0)])


@pytest.mark.parametrize("C,H,N,channels_last", [(5, 3, 4, False), (33, 22, 2, True), (4, 300, 5, False)])
def test_context_step_padding_rows_on_the_scratch_slot(C, H, N, channels_last):
    """A batch padded to its bucket repeats the scratch slot (the engine's last row) in its padding
    rows: the real rows and every other slot's state are still exact, whatever the padding writes."""
    gen = torch.Generator().manual_seed(C + H + N)
    state = torch.randn(6, C, H, generator=gen)
    slots = torch.tensor([4, 5, 0, 5, 5], dtype=torch.int64)  # slot 5: scratch
    new = torch.randn(5, N, C, generator=gen).transpose(1, 2) if channels_last else torch.randn(5, C, N, generator=gen)
    expected_state = state.clone()
    expected = context_step_reference(expected_state, slots, new, torch.full((5, C, H + N), float("nan")))
    got = context_step(state, slots, new, channels_last=channels_last)
    real = slots != 5
    assert torch.equal(got[real], expected[real])
    assert torch.equal(state[:5], expected_state[:5])


def test_context_step_rejects_mismatch():
    with pytest.raises(ValueError, match="does not fit"):
        context_step(torch.zeros(2, 4, 3), torch.tensor([0]), torch.zeros(1, 5, 2))
    with pytest.raises(ValueError, match="does not fit"):
        context_step(torch.zeros(2, 4, 3), torch.tensor([0]), torch.zeros(1, 4, 2, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_context_step_matches_reference(cuda, dtype):
    for C, H, N, channels_last in [(768, 12, 4, True), (96, 44, 2048, False), (1536, 6, 32, False), (5, 300, 3, True)]:
        state = torch.randn(9, C, H, device=cuda, dtype=dtype)
        slots = torch.tensor([8, 3, 8, 0], device=cuda)[:3 if C % 2 else 4]  # a padding row repeats the scratch slot
        B = slots.numel()
        new = torch.randn(B, N, C, device=cuda, dtype=dtype).transpose(1, 2) if channels_last \
            else torch.randn(B, C, N, device=cuda, dtype=dtype)
        expected_state = state.clone()
        expected = context_step_reference(expected_state, slots, new, torch.empty(B, C, H + N, device=cuda, dtype=dtype))
        got = context_step(state, slots, new, channels_last=channels_last)
        real = slots != 8  # rows on the scratch slot are padding: their contents are not defined
        assert torch.equal(got[real], expected[real])
        assert torch.equal(state[:8], expected_state[:8])
