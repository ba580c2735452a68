"""The transposed conv (phase GEMM) against its torch reference and the torch module."""

import pytest
import torch
from helpers import DTYPES, UPSAMPLERS, channels_last, close, d, log_uniform_alpha

from snac_fast.model.modules import FusedConvTranspose1d
from snac_fast.ops.conv_transpose import (
    conv_transpose,
    conv_transpose_reference,
    folds_batches,
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C_in,C_out,stride", UPSAMPLERS)
def test_conv_transpose_kernel(dtype, C_in, C_out, stride):
    gen = torch.Generator().manual_seed(C_in + stride)
    T = 5 if C_in >= 768 else 19
    x = torch.randn(2, C_in, T, generator=gen).to(dtype)
    w = (torch.randn(C_in, C_out, 2 * stride, generator=gen) / (C_in * 2) ** 0.5).to(dtype)
    b = torch.randn(C_out, generator=gen).to(dtype)
    alpha = log_uniform_alpha(C_in, gen)
    close(conv_transpose(x, w, b, stride, alpha_in=alpha), conv_transpose_reference(d(x), d(w), d(b), stride, d(alpha)), dtype)
    close(conv_transpose(channels_last(x), w, None, stride), conv_transpose_reference(d(x), d(w), None, stride), dtype)


@pytest.mark.parametrize("stride", [2, 3, 4, 5, 8])
def test_conv_transpose_matches_torch_module(stride, poisoned_empty):
    """Against nn.ConvTranspose1d built with SNAC's padding rule, odd lengths, every output written
    (stride 3 and 5 use padded phases)."""
    import math

    torch.manual_seed(stride)
    conv = torch.nn.ConvTranspose1d(32, 16, 2 * stride, stride=stride, padding=math.ceil(stride / 2),
                                    output_padding=stride % 2)
    for T in (1 + 2 * stride, 131):  # batches folded into the columns, then one batch per program
        assert folds_batches(3, T) == (T < 128)
        x = torch.randn(3, 32, T)
        with torch.no_grad():
            expected = conv(x.double().float())
            for layout in (x, channels_last(x)):  # [B, C, T] and [B, T, C] memory
                close(conv_transpose(layout, conv.weight, conv.bias, stride), expected, torch.float32)


@pytest.mark.parametrize("stride", [2, 4, 8, 3])
def test_phase_packing_holds_every_tap_once(stride):
    """Even strides pack two taps per phase and no zeros; odd ones three blocks with zero taps."""
    from snac_fast.ops.conv_transpose import pack_phase_weight, splits_phases

    w = torch.arange(1, 5 * 3 * 2 * stride + 1, dtype=torch.float64).view(5, 3, 2 * stride)
    packed = pack_phase_weight(w, stride)
    assert sorted(packed[packed != 0].tolist()) == sorted(w.flatten().tolist())
    if splits_phases(stride):
        assert packed.shape == (4, 3 * stride // 2, 5) and (packed != 0).all()
    else:
        assert packed.shape == (3, 3 * 4, 5)


def test_conv_transpose_repacks_when_its_weight_changes():
    torch.manual_seed(0)
    conv = FusedConvTranspose1d.from_conv(torch.nn.ConvTranspose1d(16, 8, 4, stride=2, padding=1))
    x = torch.randn(1, 16, 9)
    with torch.no_grad():
        before = conv(x)
        conv.weight.mul_(2)  # in place, as load_state_dict does
        after = conv(x)
        close(after - conv.bias.view(1, -1, 1), 2 * (before - conv.bias.view(1, -1, 1)), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C_in,C_out,stride", UPSAMPLERS)
def test_gpu_conv_transpose_kernel(cuda, dtype, C_in, C_out, stride):
    gen = torch.Generator().manual_seed(C_in + stride)
    T = 4001 if C_in <= 256 else 301
    x = torch.randn(2, C_in, T, generator=gen).to(dtype)
    w = (torch.randn(C_in, C_out, 2 * stride, generator=gen) / (C_in * 2) ** 0.5).to(dtype)
    b = torch.randn(C_out, generator=gen).to(dtype)
    alpha = log_uniform_alpha(C_in, gen)
    got = conv_transpose(x.to(cuda), w.to(cuda), b.to(cuda), stride, alpha_in=alpha.to(cuda))
    close(got.cpu(), conv_transpose_reference(d(x), d(w), d(b), stride, d(alpha)), dtype)
    got = conv_transpose(channels_last(x).to(cuda), w.to(cuda), b.to(cuda), stride)
    close(got.cpu(), conv_transpose_reference(d(x), d(w), d(b), stride), dtype)


@pytest.mark.parametrize("stride", [2, 3, 4, 8])
@pytest.mark.parametrize("B, T", [(1, 1), (3, 17)])
def test_cpu_phase_conv_is_the_transposed_conv(stride, B, T):
    """The CPU path (one conv over neighbouring inputs, its outputs the phases) against the float64
    transposed conv, with and without bias; a changed weight is packed again."""
    from snac_fast.ops.conv_transpose import conv_transpose_phases, conv_transpose_reference

    gen = torch.Generator().manual_seed(stride * 100 + T)
    x = torch.randn(B, 12, T, generator=gen)
    weight, bias = torch.randn(12, 5, 2 * stride, generator=gen), torch.randn(5, generator=gen)
    for b in (bias, None):
        want = conv_transpose_reference(x.double(), weight.double(), None if b is None else b.double(), stride)
        got = conv_transpose_phases(x, weight, b, stride)
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        weight.mul_(-2)  # in place: a new version
    torch.testing.assert_close(conv_transpose_phases(x, weight, bias, stride).double(),
                               conv_transpose_reference(x.double(), weight.double(), bias.double(), stride),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.heavy
def test_cpu_stream_through_the_phase_conv_equals_the_whole_decode():
    """Without Triton's interpreter (as users run on a CPU): the fused modules' transposed convs
    take the phase conv, and an exact stream of the stage step (a CPU's approximate and half streams
    and short decodes run the module tree) still equals the whole decode (float32 >= 100 dB)."""
    import os
    import subprocess
    import sys

    script = """
import torch
from snac_fast import FastSNAC
from snac_fast.metrics import snr_db
from snac_fast.model.synthetic import synthetic_model
from snac_fast.ops import conv_transpose
from snac_fast.orpheus import ORPHEUS
calls = []
phases = conv_transpose.conv_transpose_phases
conv_transpose.conv_transpose_phases = lambda *a: calls.append(1) or phases(*a)
codec = FastSNAC(synthetic_model("snac_24khz", decoder_dim=256, encoder_dim=16), device="cpu")
gen = torch.Generator().manual_seed(5)
ids = (torch.randint(0, 4096, (13, 7), generator=gen) + ORPHEUS.offset + torch.arange(7) * 4096).reshape(-1)
from snac_fast.streaming import DecoderStream
stream = DecoderStream(codec.stream_engine(1, layered=False), 2, layout=ORPHEUS)
parts = [stream.push_ids(ids[k:k + 7].tolist()) for k in range(0, ids.numel(), 7)] + [stream.flush()]
got = torch.cat([torch.as_tensor(p).reshape(-1) for p in parts]).double()
with torch.inference_mode():
    want = codec.decode(ORPHEUS.ids_to_codes(ids.numpy()), seed=2)[0, 0].double()
print(len(calls) > 0, got.shape == want.shape, float(snr_db(want, got)))
"""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    took_phases, same_shape, snr = out.stdout.split()
    assert took_phases == "True" and same_shape == "True" and float(snr) >= 100, out.stderr[-2000:]
