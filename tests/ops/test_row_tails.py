"""clear_row_tails (the encoder's rows-as-alone): the kernel and the torch form against a loop."""

import pytest
import torch

from snac_fast.ops import row_tails
from snac_fast.ops.row_tails import clear_row_tails, clear_row_tails_reference


def cleared_by_loop(t: torch.Tensor, lengths: list[int], total: int, width: int) -> torch.Tensor:
    out = t.clone()
    steps = t.shape[-1]
    for b, n in enumerate(lengths):
        end = n * steps // total
        out[b, :, end:end + width] = 0
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape, width", [((5, 7, 131), 27), ((3, 70, 64), 3), ((1, 1, 9), 40), ((4, 33, 257), 1)])
def test_clears_exactly_the_steps_past_each_rows_end(dtype, shape, width):
    B, C, T = shape
    total = T * 3  # the batch's length in samples: each step 3 samples here
    gen = torch.Generator().manual_seed(B * C + T + width)
    # a row that fills the batch, one that is empty, one ending a step before the end, random others
    lengths = [total, 0, total - 3] + torch.randint(0, total + 1, (B,), generator=gen).tolist()
    lengths = lengths[:B]
    t = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) + 1  # no zeros to start with
    want = cleared_by_loop(t, lengths, total, width)
    got = clear_row_tails(t.clone(), torch.tensor(lengths), total, width)
    assert torch.equal(got, want)
    assert torch.equal(clear_row_tails_reference(t.clone(), torch.tensor(lengths), total, width), want)


def test_any_strides_and_in_place():
    base = torch.randn(6, 40, 3) + 5  # [B, T, C] memory, seen as [B, C, T]
    t = base.permute(0, 2, 1)
    lengths = torch.tensor([12, 40, 0, 7, 39, 25])
    want = cleared_by_loop(t, lengths.tolist(), 40, 5)
    assert clear_row_tails(t, lengths, 40, 5) is t
    assert torch.equal(t, want) and torch.equal(base.permute(0, 2, 1), want)


def test_the_kernel_ran_and_bad_arguments_are_refused(monkeypatch):
    t = torch.ones(2, 3, 8)
    if row_tails.runs_triton(t):  # the interpreter (CI) or a GPU: the reference must not stand in
        monkeypatch.setattr(row_tails, "clear_row_tails_reference", None)
    clear_row_tails(t, torch.tensor([8, 4]), 8, 3)
    assert t[1, :, 4:7].eq(0).all() and t[1, :, 7].eq(1).all() and t[0].eq(1).all()
    with pytest.raises(ValueError, match="lengths"):
        clear_row_tails(t, torch.tensor([8, 4], dtype=torch.int32), 8, 3)
    with pytest.raises(ValueError, match=r"t \[B, C, T\]"):
        clear_row_tails(t, torch.tensor([8, 4, 1]), 8, 3)
    assert torch.equal(clear_row_tails(t.clone(), torch.tensor([0, 0]), 8, 0), t)  # width 0: nothing


@pytest.mark.gpu
def test_on_the_gpu_as_the_loop():
    t = torch.randn(9, 48, 1000, device="cuda", dtype=torch.float16) + 3
    lengths = torch.randint(0, 4000, (9,)).tolist()
    want = cleared_by_loop(t, lengths, 4000, 27)
    assert torch.equal(clear_row_tails(t, torch.tensor(lengths, device="cuda"), 4000, 27), want)
