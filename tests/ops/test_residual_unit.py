"""The one-kernel residual unit (Gluon, Hopper): its tiling and dispatch on CPU; the kernel against
float64 references and the two-kernel path on the GPU."""

import pytest
import torch
from helpers import close, d, fused_copy, log_uniform_alpha, upstream_unit

from snac_fast.ops import residual_unit as ru
from snac_fast.ops.snake import snake_reference


def unit_inputs(B, C, T, gen, device="cpu", dtype=torch.float16):
    """x, s = snake(x), the unit's weights (dw [C,1,7], its bias, alpha2, pw [C,C,1], its bias) and
    an output alpha, in dtype (alphas float32, as the modules keep them)."""
    x = torch.randn(B, C, T, generator=gen) * 0.5
    a1, a2, a_out = (log_uniform_alpha(C, gen) for _ in range(3))
    to = lambda t: t.to(dtype).to(device)  # noqa: E731
    s = snake_reference(x.to(dtype).double(), a1.double())  # of x as rounded
    dw_w, dw_b = torch.randn(C, 1, 7, generator=gen) * 0.3, torch.randn(C, generator=gen) * 0.1
    pw_w, pw_b = torch.randn(C, C, 1, generator=gen) / C**0.5, torch.randn(C, generator=gen) * 0.1
    return (to(x), to(s), to(dw_w), to(dw_b), to(pw_w), to(pw_b),
            a2.to(device), a_out.to(device))


@pytest.mark.parametrize("C", [1, 16, 48, 64, 96, 100, 128])
def test_unit_tiling_fits_the_kernel(C):
    """Every channel count up to the limit gets a tile the kernel's layouts accept: channels padded
    to a power of two, a tile of wgmma's M (a multiple of 64 steps) split in runs of 8 over the
    warps' 32 lanes, the MMA's N split over the warps beside M into multiples of 8, and at most 4
    runs of 8 outputs a thread (the register bound measured at 128 channels)."""
    c_p, bt, warps, warps_m = ru.unit_tiling(C)
    assert c_p >= C and c_p & (c_p - 1) == 0
    assert bt % 64 == 0 and 32 % (bt // 8) == 0
    assert warps % warps_m == 0 and bt % (16 * warps_m) == 0
    assert (c_p // (warps // warps_m)) % 8 == 0
    assert c_p * bt // 8 <= 4 * 32 * warps


@pytest.mark.parametrize("C", [0, 129, 192, 768])
def test_unit_tiling_refuses_what_does_not_fit(C):
    with pytest.raises(ValueError, match="channels"):
        ru.unit_tiling(C)


def test_unit_is_taken_where_it_measured_faster():
    """Up to 64 channels at every dilation; 128 channels at dilations 1 and 3 only (at 9 the one
    kernel measured 0.88-0.96x the two); 96 channels (a padded tile) and wider units never."""
    assert all(ru.unit_is_faster(c, d) for c in (1, 48, 64) for d in (1, 3, 9))
    assert ru.unit_is_faster(128, 1) and ru.unit_is_faster(128, 3) and not ru.unit_is_faster(128, 9)
    assert not any(ru.unit_is_faster(c, d) for c in (65, 96, 127, 129, 256) for d in (1, 3, 9))


def test_unit_applies_only_to_fp16_cuda_within_limits(monkeypatch):
    """CPU tensors, float32 and units where it measured slower keep the two kernels; so does
    SNAC_FAST_GLUON=0."""
    x = torch.zeros(1, 64, 8, dtype=torch.float16)
    assert not ru.unit_applies(x, 64, 1)  # CPU
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and ru.HAS_GLUON:
        xc = x.cuda()
        assert ru.unit_applies(xc, 64, 9) and ru.unit_applies(xc, 48, 3) and ru.unit_applies(xc, 128, 3)
        assert not ru.unit_applies(xc.float(), 64, 1) and not ru.unit_applies(xc, 96, 9)
        from snac_fast.ops.device import GPUS, emulate_gpu
        with emulate_gpu(GPUS["a100"]):  # the launch rules' view of the card decides
            assert not ru.unit_applies(xc, 64, 1)
        monkeypatch.setenv("SNAC_FAST_GLUON", "0")
        assert not ru.unit_applies(xc, 64, 1)


def test_unit_reference_is_the_upstream_unit():
    """The reference (float64) equals upstream's ResidualUnit on the same weights: snake, dilated
    depthwise conv, snake, 1x1 conv, plus x (to float32 rounding: weight norm is folded in float32)."""
    unit = upstream_unit(32, 3, seed=5).double()
    fused = fused_copy(unit).double()
    snake1, dw, snake2, pw = fused.block
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 32, 101, generator=gen, dtype=torch.float64)
    s = snake_reference(x, snake1.alpha)
    got = ru.residual_unit_reference(x, s, dw.weight, dw.bias, 3, snake2.alpha, pw.weight, pw.bias)
    with torch.no_grad():
        torch.testing.assert_close(got, unit(x), rtol=1e-5, atol=1e-6)


def test_residual_unit_checks_its_arguments():
    gen = torch.Generator().manual_seed(0)
    x, s, dw_w, dw_b, pw_w, pw_b, a2, a_out = unit_inputs(1, 16, 24, gen)
    with pytest.raises(ValueError, match="contiguous"):
        ru.residual_unit(x, s[..., :20], dw_w, dw_b, 1, a2, pw_w, pw_b)
    with pytest.raises(ValueError, match="weights"):
        ru.residual_unit(x, s, dw_w[:, :, :5], dw_b, 1, a2, pw_w, pw_b)
    with pytest.raises(ValueError, match="biases"):
        ru.residual_unit(x, s, dw_w, None, 1, a2, pw_w, pw_b)
    with pytest.raises(ValueError, match="exclusive"):
        ru.residual_unit(x, s, dw_w, dw_b, 1, a2, pw_w, pw_b, pair_alpha=a_out, alpha_out=a_out)


def _hopper_gluon() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and ru.HAS_GLUON


@pytest.mark.gpu
@pytest.mark.parametrize("dilation", [1, 3, 9])
@pytest.mark.parametrize("C", [64, 128, 96, 48])
def test_gpu_residual_unit_kernel(cuda, C, dilation):
    """Every output mode against float64, outputs poisoned first: the pair (y over x, snake(y) in a
    fresh buffer), snake(y) alone channels-first and channels-last, and y; lengths with ragged last
    tiles, a single short tile, T not a multiple of 8, and a batch."""
    if not _hopper_gluon():
        pytest.fail("the Gluon unit needs an sm_90 GPU and Triton with Gluon")
    for B, T in [(1, 20001), (3, 8), (2, 4099), (1, 8192)]:
        gen = torch.Generator().manual_seed(C * 7 + dilation + T)
        x, s, dw_w, dw_b, pw_w, pw_b, a2, a_out = unit_inputs(B, C, T, gen, cuda)
        ref_y = ru.residual_unit_reference(d(x), d(s), d(dw_w), d(dw_b), dilation, d(a2), d(pw_w), d(pw_b))
        ref_s = snake_reference(ref_y, d(a_out))
        unit = (s, dw_w, dw_b, dilation, a2, pw_w, pw_b)
        xc = x.clone()
        y, sy = ru.residual_unit(xc, *unit, pair_alpha=a_out, out=xc)
        assert y is xc and sy.data_ptr() not in (s.data_ptr(), xc.data_ptr())
        close(y, ref_y, torch.float16)
        close(sy, ref_s, torch.float16)
        poisoned = torch.full_like(x, float("nan"))
        close(ru.residual_unit(x, *unit, alpha_out=a_out, out=poisoned), ref_s, torch.float16)
        cl = ru.residual_unit(x, *unit, alpha_out=a_out, channels_last=True)
        assert cl.transpose(1, 2).is_contiguous()
        close(cl, ref_s, torch.float16)
        close(ru.residual_unit(x, *unit), ref_y, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dilation", [1, 9])
def test_gpu_fused_unit_module_takes_the_kernel(cuda, dilation, monkeypatch):
    """FusedResidualUnit (fp16, 64 channels) on the Gluon kernel against the same module on the two
    kernels (SNAC_FAST_GLUON=0) and upstream float64: the pair it hands the next unit, and the
    channels-last snake a block's last unit writes."""
    if not _hopper_gluon():
        pytest.fail("the Gluon unit needs an sm_90 GPU and Triton with Gluon")
    from snac_fast.model.modules import FastSnake1d

    unit = upstream_unit(64, dilation, seed=dilation)
    fused = fused_copy(unit).half().to(cuda)
    nxt = FastSnake1d(64).to(cuda)
    nxt.alpha.data = log_uniform_alpha(64, torch.Generator().manual_seed(1)).reshape(1, 64, 1).to(cuda)
    x = (torch.randn(2, 64, 3000, generator=torch.Generator().manual_seed(2)) * 0.5).to(cuda)
    with torch.no_grad():
        ref = unit.double().to(cuda)(x.double())
        fused.pair_next_snake(nxt)
        s = snake_reference(x, fused.block[0].alpha).half()
        for gluon in ("1", "0"):
            monkeypatch.setenv("SNAC_FAST_GLUON", gluon)
            y, sy = fused((x.half().clone(), s.clone()))
            close(y, ref, torch.float16)
            close(sy, snake_reference(ref, nxt.alpha.double()), torch.float16)
        object.__setattr__(fused, "snake_pair", None)
        fused.absorb_next_snake(nxt)
        fused.write_channels_last()
        monkeypatch.setenv("SNAC_FAST_GLUON", "1")
        out = fused((x.half().clone(), s.clone()))
        assert out.transpose(1, 2).is_contiguous()
        close(out, snake_reference(ref, nxt.alpha.double()), torch.float16)
