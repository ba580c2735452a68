"""Snake op: kernels (interpreter on CPU, compiled on CUDA) against float64 references."""

import pytest
import torch

import snac_fast
from snac_fast import FastSnake1d, snake, snake_reference
from snac_fast.ops.device import runs_triton
from snac_fast.ops.snake import snake_backward_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def subnormal_step(dtype):
    """Absolute rounding floor of a dtype: results below its normal range round to this spacing."""
    return torch.finfo(dtype).tiny * 2 * UNIT_ROUNDOFF[dtype]


def random_alpha(C, gen, device="cpu", lo=1e-4, hi=5.0, signed=True):
    """Log-uniform magnitudes in [lo, hi], a random sign on some channels: fresh per call."""
    mag = torch.exp(torch.empty(C, dtype=torch.float64).uniform_(torch.log(torch.tensor(lo)).item(), torch.log(torch.tensor(hi)).item(), generator=gen))
    if signed:
        mag = mag * torch.where(torch.rand(C, generator=gen, dtype=torch.float64) < 0.25, -1.0, 1.0)
    return mag.float().to(device)


def forward_tolerance(x, alpha, ref, dtype):
    """Per-element bound: float32 rounding of alpha*x (<= |x| * 2^-23 in y), the 2e-6 sine budget
    scaled by 1/|alpha|, and the output's rounding to its dtype."""
    a = alpha.reshape(1, -1, 1).double().abs()
    return 2.0**-22 * x.double().abs() + 2e-6 / (a + 1e-9) + 2 * UNIT_ROUNDOFF[dtype] * ref.abs() + subnormal_step(dtype)


def check_forward(x, alpha):
    y = snake(x, alpha)
    ref = snake_reference(x.double(), alpha.double())
    assert y.dtype == x.dtype and y.shape == x.shape and y.is_contiguous()
    err = (y.double() - ref).abs()
    tol = forward_tolerance(x, alpha, ref, x.dtype)
    assert torch.isfinite(y).all()
    assert (err <= tol).all(), f"max err {err.max().item():.3g}, worst ratio {(err / tol).max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 7), (1, 4, 1023), (3, 2, 1025), (1, 64, 300), (2, 5, 4097)])
def test_forward_matches_float64(dtype, shape):
    gen = torch.Generator().manual_seed(hash((shape, str(dtype))) % 2**31)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 4).to(dtype)
    check_forward(x, random_alpha(shape[1], gen))


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_large_arguments_and_tiny_alpha(dtype):
    gen = torch.Generator().manual_seed(7)
    x = (torch.rand(2, 6, 513, generator=gen, dtype=torch.float64) * 2000 - 1000).to(dtype)
    alpha = torch.tensor([1e-4, -1e-4, 0.37, 1.0, -2.5, 1.0], dtype=torch.float32)  # |alpha*x| <= 2500
    check_forward(x, alpha)


def test_many_rows_tiny_time():
    """B*C past 65,535 (where a 2D grid with rows on axis 1 dies) with T = 1 and T = 3."""
    gen = torch.Generator().manual_seed(3)
    for shape in [(3, 30000, 1), (1, 70001, 3)]:
        x = torch.randn(shape, generator=gen)
        check_forward(x, random_alpha(shape[1], gen))


def test_empty_inputs():
    alpha = torch.ones(4)
    for shape in [(2, 4, 0), (0, 4, 9)]:
        y = snake(torch.randn(shape), alpha)
        assert y.shape == shape


def test_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(2, 37, 9, generator=gen)  # [B, T, C] -> permuted to [B, C, T], stride_t = C
    alpha = random_alpha(9, gen)
    check_forward(base.permute(0, 2, 1), alpha)
    sliced = torch.randn(2, 9, 80, generator=gen)[:, :, 1::3]
    check_forward(sliced, alpha)
    check_forward(torch.randn(4, 18, 30, generator=gen)[::2, ::2, :], alpha)


@pytest.mark.parametrize("alpha_dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_alpha_shapes_and_dtypes(alpha_dtype):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, 50, generator=gen)
    alpha = random_alpha(6, gen).to(alpha_dtype)
    y_flat = snake(x, alpha)
    y_3d = snake(x, alpha.reshape(1, 6, 1))
    assert torch.equal(y_flat, y_3d)
    check_forward(x, alpha)


def test_every_output_element_written(poisoned_empty):
    """Outputs come from torch.empty: poisoned with NaN, an element a kernel skips shows."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 777, generator=gen, requires_grad=True)
    alpha = random_alpha(5, gen).requires_grad_()
    y = snake(x, alpha)
    assert torch.isfinite(y).all()
    y.backward(torch.randn_like(y))
    assert torch.isfinite(x.grad).all() and torch.isfinite(alpha.grad).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_stay_where_they_are(dtype):
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 4, 301, generator=gen).to(dtype)
    flat = x.view(-1)
    idx = torch.randperm(flat.numel(), generator=gen)[:30]
    flat[idx[:10]] = float("nan")
    flat[idx[10:20]] = float("inf")
    flat[idx[20:]] = float("-inf")
    y = snake(x, random_alpha(4, gen))
    assert torch.equal(torch.isfinite(y), torch.isfinite(x))


def check_backward(x, alpha):
    x = x.detach().requires_grad_()
    alpha = alpha.detach().requires_grad_()
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(x.numel())).to(x.dtype)
    snake(x, alpha).backward(g)
    xd = x.detach().double().requires_grad_()
    ad = alpha.detach().double().requires_grad_()
    snake_reference(xd, ad).backward(g.double())
    a = ad.detach().reshape(1, -1, 1).abs()
    # dx: |d(sin(2ax))| <= 2|x| * float32 rounding of a*x, plus the sine budget, plus dx's rounding
    dx_tol = g.double().abs() * (2.0**-21 * (a * x.double()).abs() + 4e-6) + 2 * UNIT_ROUNDOFF[x.dtype] * xd.grad.abs() + subnormal_step(x.dtype)
    assert x.grad.dtype == x.dtype
    assert ((x.grad.double() - xd.grad).abs() <= dx_tol).all()
    # dalpha: a float32 sum; bound by the sum of the terms' magnitudes (the problem's conditioning)
    inv = 1 / (a + 1e-9)
    terms = (g.double() * inv * (x.double().abs() + inv)).abs().sum(dim=(0, 2))
    assert alpha.grad.shape == alpha.shape and alpha.grad.dtype == alpha.dtype
    err = (alpha.grad.double().reshape(-1) - ad.grad.reshape(-1)).abs()
    assert (err <= 2e-5 * terms + 1e-9).all(), f"dalpha err {err.max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 7), (1, 4, 1025), (3, 2, 4097)])
def test_backward_matches_float64(dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    check_backward(x, random_alpha(shape[1], gen, lo=1e-2).reshape(1, -1, 1))


def test_backward_non_contiguous_and_many_rows():
    gen = torch.Generator().manual_seed(4)
    check_backward(torch.randn(2, 33, 6, generator=gen).permute(0, 2, 1), random_alpha(6, gen, lo=1e-2))
    check_backward(torch.randn(1, 70001, 2, generator=gen), random_alpha(70001, gen, lo=1e-2))


def test_dalpha_is_deterministic():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(4, 8, 3000, generator=gen)
    alpha = random_alpha(8, gen)
    g = torch.randn_like(x)
    grads = []
    for _ in range(2):
        a = alpha.clone().requires_grad_()
        snake(x, a).backward(g)
        grads.append(a.grad)
    assert torch.equal(grads[0], grads[1])


def test_backward_reference_is_the_derivative():
    """The analytic backward (used by the float64 path of the op) passes gradcheck."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 17, dtype=torch.float64, generator=gen, requires_grad=True)
    alpha = random_alpha(3, gen, lo=0.1).double().reshape(1, 3, 1).requires_grad_()
    assert torch.autograd.gradcheck(snake, (x, alpha))
    g = torch.randn(2, 3, 17, dtype=torch.float64, generator=gen)
    dx, dalpha = snake_backward_reference(g, x.detach(), alpha.detach())
    ref_dx, ref_dalpha = torch.autograd.grad(snake_reference(x, alpha), (x, alpha), g)
    torch.testing.assert_close(dx, ref_dx)
    torch.testing.assert_close(dalpha, ref_dalpha.reshape(-1))


def test_errors_name_the_problem():
    x = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="floating x"):
        snake(torch.ones(2, 3, 5, dtype=torch.int32), torch.ones(3))
    with pytest.raises(ValueError, match="floating alpha"):
        snake(x, torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[B, C, T\]"):
        snake(torch.randn(3, 5), torch.ones(3))
    with pytest.raises(ValueError, match="alpha must be shaped"):
        snake(x, torch.ones(4))
    with pytest.raises(ValueError, match="meta"):
        snake(x, torch.ones(3, device="meta"))


def test_kernel_path_is_exercised():
    """The Triton kernels run, not the torch fallback: on CPU (CI) through the interpreter."""
    assert runs_triton(torch.empty(1, device="cuda" if torch.cuda.is_available() else "cpu"))


def test_fast_snake1d_is_a_drop_in():
    from snac.layers import Snake1d

    up = Snake1d(6)
    with torch.no_grad():
        up.alpha.copy_(random_alpha(6, torch.Generator().manual_seed(0), signed=False).reshape(1, 6, 1))
    fast = FastSnake1d.from_snake(up)
    assert fast.alpha is up.alpha
    fresh = FastSnake1d(6)
    fresh.load_state_dict(up.state_dict())
    x = torch.randn(2, 6, 99)
    # no_grad: upstream's Snake is TorchScript, whose executor, once it has run it with autograd on,
    # fails every later call of it under inference_mode in this process (the upstream decodes of
    # other tests: "Inference tensors cannot be saved for backward")
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), up(x), rtol=1e-6, atol=2e-6)
        torch.testing.assert_close(fast(x), up(x), rtol=1e-6, atol=2e-6)
    with pytest.raises(ValueError):
        FastSnake1d.from_snake(torch.nn.Identity())


# --- sine accuracy, measured on the kernel's own helpers ------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from snac_fast.ops.snake import _cos_reduced, _reduce_by_pi, _sin_reduced  # noqa: E402


@triton.jit
def sine_probe(y_ptr, sin2_ptr, sin2y_ptr, n, BLOCK: tl.constexpr):
    """The kernels' own reduction and polynomials, exposed on a flat array of arguments."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    y = tl.load(y_ptr + offs, mask=m)
    r = _reduce_by_pi(y)
    s = _sin_reduced(r)
    tl.store(sin2_ptr + offs, s * s, mask=m)
    tl.store(sin2y_ptr + offs, 2.0 * s * _cos_reduced(r), mask=m)


def test_fast_sine_error_below_2e6():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(12345)
    pi = torch.pi
    y = torch.cat([
        torch.rand(400_000, generator=gen, dtype=torch.float64) * 2000 - 1000,
        torch.linspace(-8, 8, 100_001, dtype=torch.float64),
        (torch.arange(-636, 637, dtype=torch.float64) * pi / 2).repeat_interleave(3) + torch.tensor([-1e-4, 0, 1e-4]).repeat(1273).double(),
    ]).float().to(device)
    sin2 = torch.empty_like(y)
    sin2y = torch.empty_like(y)
    sine_probe[(triton.cdiv(y.numel(), 65536),)](y, sin2, sin2y, y.numel(), BLOCK=65536)
    yd = y.double()  # exact float64 value of each float32 argument
    err_sin2 = (sin2.double() - torch.sin(yd) ** 2).abs().max().item()
    err_sin2y = (sin2y.double() - torch.sin(2 * yd)).abs().max().item()
    print(f"fast sine max abs error on |y| <= 1000: sin^2 {err_sin2:.3g}, sin(2y) {err_sin2y:.3g}")
    assert err_sin2 < 2e-6
    assert err_sin2y < 2e-6


# --- GPU: the same checks at SNAC's real shapes ---------------------------------------------------

SNAC_SHAPES = [(1, 1024, 236), (1, 512, 1888), (1, 256, 15104), (1, 128, 60416), (1, 64, 120832)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SNAC_SHAPES + [(128, 1024, 16), (3, 64, 120833)])
def test_gpu_forward_backward_real_shapes(cuda, dtype, shape):
    assert runs_triton(torch.empty(1, device=cuda))
    gen = torch.Generator().manual_seed(shape[1] * shape[2] % 2**31)
    x = (torch.randn(shape, generator=gen) * 4).to(dtype)
    alpha = random_alpha(shape[1], gen, lo=1e-2)
    check_forward(x.to(cuda), alpha.to(cuda))
    xg, ag = x.to(cuda).requires_grad_(), alpha.to(cuda).requires_grad_()
    g = torch.randn(shape, generator=gen).to(dtype)
    snake(xg, ag).backward(g.to(cuda))
    dx_ref, da_ref = snake_backward_reference(g.double().to(cuda), x.double().to(cuda), alpha.double().to(cuda))
    torch.testing.assert_close(xg.grad.double(), dx_ref, rtol=4 * UNIT_ROUNDOFF[dtype], atol=1e-5 * 4 * 5)
    terms = (g.double().abs().to(cuda) * (x.double().abs().to(cuda) + 1 / alpha.double().abs().reshape(1, -1, 1).to(cuda)) / alpha.double().abs().reshape(1, -1, 1).to(cuda)).sum(dim=(0, 2))
    assert ((ag.grad.double() - da_ref).abs() <= 2e-5 * terms).all()
    first = ag.grad.clone()
    ag.grad = None
    snake(xg, ag).backward(g.to(cuda))
    assert torch.equal(first, ag.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_half_snake_sfu_sine_within_its_error_bound(cuda, dtype):
    """fp16/bf16 outputs take the sine from the SFU (sin.approx.f32, ops/snake ``_sin_sfu``): sin^2(ax)/a
    then errs by about 2|x| 2^-21 plus alpha*x's own rounding, whatever alpha is. Checked where that is
    hardest, |x| to 1000 (arguments to 2500) and alphas from 1e-4 to 2.5, against float64 and without
    the float32 path's 2e-6/|alpha| allowance: within |x| 2^-18 plus the output's rounding."""
    gen = torch.Generator().manual_seed(11)
    wide = torch.rand(2, 64, 4097, generator=gen, dtype=torch.float64) * 2000 - 1000
    x = torch.cat([wide, torch.randn(2, 64, 4097, generator=gen, dtype=torch.float64) * 4], dim=-1).to(dtype)
    alpha = random_alpha(64, gen, lo=1e-4, hi=2.5)
    y = snake(x.to(cuda), alpha.to(cuda)).double().cpu()
    ref = snake_reference(x.double(), alpha.double())
    tol = 2.0**-18 * x.double().abs() + 2 * UNIT_ROUNDOFF[dtype] * ref.abs() + subnormal_step(dtype)
    err = (y - ref).abs()
    assert (err <= tol).all(), f"max err {err.max().item():.3g}, worst ratio {(err / tol).max().item():.3g}"


@pytest.mark.gpu
def test_gpu_mixed_devices_rejected(cuda):
    with pytest.raises(ValueError, match="cuda"):
        snake(torch.randn(1, 2, 3, device=cuda), torch.ones(2))
    assert snac_fast.snake(torch.randn(1, 2, 0, device=cuda), torch.ones(2, device=cuda)).shape == (1, 2, 0)
