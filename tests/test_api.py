"""FastSNAC: surgery, decode/encode against upstream with the same noise, accelerate, validation."""

import pytest
import torch
from helpers import (
    NARROW,
    PERTURBATIONS,
    assert_matches_upstream_fp32,
    perturb,
    random_codes,
)
from snac.layers import NoiseBlock, Snake1d
from torch.nn.utils import parametrize

from snac_fast import FastSNAC, FastSnake1d, accelerate
from snac_fast.configs import published_config
from snac_fast.fidelity import decode_with_noise
from snac_fast.metrics import max_abs_error, snr_db
from snac_fast.model.local_attention import HalfLocalMHA
from snac_fast.model.modules import FusedConvTranspose1d
from snac_fast.model.noise import decode_with_keyed_noise, noise_blocks
from snac_fast.model.synthetic import synthetic_model

MODELS = ["snac_24khz", "snac_32khz", "snac_44khz"]


def coarse_frames(config):
    """A short valid length: the 32/44 kHz attention needs multiples of 4 coarse frames."""
    return 4 if config["attn_window_size"] else 2


@pytest.mark.parametrize("name", MODELS)
def test_surgery_counts_types_and_tree(name):
    upstream = synthetic_model(name)
    before = {n: type(m) for n, m in upstream.named_modules()}
    fast = FastSNAC(synthetic_model(name), device="cpu")
    assert len(fast.report.decoder_snakes) == 29 and len(fast.report.encoder_snakes) == 28
    assert len(fast.swapped) == 57
    assert all(n.startswith("decoder.") for n in fast.report.decoder_snakes)
    after = {n: m for n, m in fast.model.named_modules()}
    assert not any(isinstance(m, Snake1d) for m in after.values())
    assert sum(isinstance(m, FastSnake1d) for m in fast.model.decoder.modules()) == 29
    assert not any(parametrize.is_parametrized(m) for m in after.values())
    fused = fast.report.fused
    assert len(fused["residual_units"]) == 12 and len(fused["noise_blocks"]) == 4 and len(fused["conv_transposes"]) == 4
    assert fused["quantizer"] == ["quantizer"] and len(fused["input_convs"]) == len(fused["output_conv"]) == 1
    assert len(fused["encoder_dense_convs"]) == 5 and len(fused["encoder_residual_units"]) == 12
    # absorbed: decoder: the input 1x1 conv, the tanh, the 4 block-input snakes, the output snake and
    # the first snake of each of the 12 residual units; encoder: the snake before each of the 4
    # strided convs and the first snake of each of the 12 residual units
    assert len(fast.report.absorbed) == 19 + 16
    summary = str(fast.report)  # counts per kind, not hundreds of names
    assert summary == repr(fast.report) and len(summary) < 400 and "decoder." not in summary
    assert "decoder snakes: 29" in summary and "fused residual units: 12" in summary and "absorbed" in summary
    # same tree: every module name survives; Snake1d becomes FastSnake1d, parametrized convs plain
    # convs, fused layers subclasses of the layers they replace (which keep the same children)
    assert set(before) - {n for n in before if ".parametrizations" in n} == set(after)
    for n, m in after.items():
        if before[n] is Snake1d:
            assert isinstance(m, FastSnake1d)
            assert n in fast.swapped
        elif not before[n].__name__.startswith("Parametrized"):
            assert isinstance(m, before[n]), n
    assert {type(m).__name__ for n, m in after.items() if type(m) is not before[n] and before[n] is not Snake1d
            and not before[n].__name__.startswith("Parametrized")} == {
        "FusedResidualVectorQuantize", "FusedResidualUnit", "FusedNoiseBlock", "AbsorbedTanh"}
    assert {type(m).__name__ for n, m in after.items() if before[n].__name__.startswith("Parametrized")} == {
        "Conv1d", "DepthwisePointwiseConv1d", "AbsorbedConv1d", "FusedConvTranspose1d", "OutputConvTanh",
        "FusedDenseConv1d", "DepthwiseConv1d"}


@pytest.mark.parametrize("name, narrow", [("snac_24khz", False), ("snac_32khz", True), ("snac_44khz", True)])
def test_decode_matches_upstream_with_same_noise(name, narrow):
    """The 32/44 kHz networks (identical but for the sampling rate) run narrow (helpers.NARROW):
    test_reference decodes them at full width against upstream's waveforms."""
    fast = FastSNAC(synthetic_model(name, **NARROW if narrow else {}), device="cpu", dtype=torch.float32)
    ref = fast.reference_model()
    codes = random_codes(fast.config, coarse_frames(fast.config), batch=2, seed=1)
    out = fast.decode(codes, generator=torch.Generator().manual_seed(5))
    expected = decode_with_noise(ref, codes, 5, torch.device("cpu"))
    assert out.shape == expected.shape == (2, 1, fast.latent_length(codes) * fast.hop_length)
    assert_matches_upstream_fp32(expected, out)


@pytest.mark.parametrize("what", list(PERTURBATIONS) + ["the noise key"])
def test_upstream_comparison_rejects_a_small_error(what):
    """A kernel 1e-4 off in one layer must not pass the comparison above: perturb one tensor of the
    model snac-fast is built from by (1 + 1e-4) (or draw the noise from the next seed), decode,
    compare with the unperturbed upstream."""
    codes = random_codes(published_config("snac_24khz"), 2, batch=2, seed=1)
    model, seed = synthetic_model("snac_24khz"), 5
    if what in PERTURBATIONS:
        perturb(model, what, codes)
    else:
        seed += 1
    fast = FastSNAC(model, device="cpu", dtype=torch.float32)
    expected = decode_with_noise(synthetic_model("snac_24khz"), codes, 5, torch.device("cpu"))
    with pytest.raises(AssertionError, match="dB"):
        assert_matches_upstream_fp32(expected, fast.decode(codes, generator=torch.Generator().manual_seed(seed)))


def test_accelerate_an_upstream_model_in_place():
    model = synthetic_model("snac_24khz")
    codes = random_codes(published_config("snac_24khz"), 2, seed=3)
    expected = decode_with_noise(model, codes, 9, torch.device("cpu"))
    report = accelerate(model)
    assert len(report.decoder_snakes) == 29 and len(report.encoder_snakes) == 28 and len(report.folded_weight_norms) > 0
    assert_matches_upstream_fp32(expected, decode_with_noise(model, codes, 9, torch.device("cpu")))
    again = accelerate(model)  # idempotent: nothing left to swap, counts still checked
    assert again.decoder_snakes == [] and again.folded_weight_norms == []


def test_accelerate_options():
    model = synthetic_model("snac_24khz")
    report = accelerate(model, encoder=False, fold_weights=False, fuse=False)
    assert report.encoder_snakes == [] and report.folded_weight_norms == [] and report.fused_residual_units == []
    assert sum(isinstance(m, Snake1d) for m in model.encoder.modules()) == 28
    assert any(parametrize.is_parametrized(m) for m in model.modules())
    with pytest.raises(ValueError, match="snac.SNAC"):
        accelerate(torch.nn.Linear(2, 2))
    untouched = synthetic_model("snac_24khz")
    with pytest.raises(ValueError, match="fuse=True needs fold_weights=True"):
        accelerate(untouched, fold_weights=False)
    assert sum(isinstance(m, Snake1d) for m in untouched.modules()) == 57  # refused before any change


def test_seed_makes_noise_reproducible():
    fast = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu")
    codes = random_codes(fast.config, 2, seed=4)
    a, b = fast.decode(codes, seed=1), fast.decode(codes, seed=1)
    assert torch.equal(a, b)
    assert not torch.equal(a, fast.decode(codes, seed=2))
    assert not torch.equal(fast.decode(codes), fast.decode(codes))  # upstream semantics: fresh noise
    assert len(fast.model.decoder.model) and all("forward" not in vars(m) for m in fast.model.modules() if isinstance(m, NoiseBlock))


def test_decode_accepts_codes_on_any_device_and_int32():
    fast = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu")
    codes = random_codes(fast.config, 2, seed=6)
    a = fast.decode(codes, seed=0)
    b = fast.decode([c.to(torch.int32) for c in codes], seed=0)
    assert torch.equal(a, b)


def test_encode_matches_upstream():
    fast = FastSNAC.from_pretrained("synthetic:snac_24khz", device="cpu")
    ref = fast.reference_model()
    audio = torch.randn(2, 1, 2500, generator=torch.Generator().manual_seed(0)) * 0.1  # full widths, a length to pad
    codes = fast.encode(audio)
    with torch.inference_mode():
        expected = ref.encode(audio)
    assert [c.shape for c in codes] == [c.shape for c in expected]
    agree = sum((a == b).sum().item() for a, b in zip(codes, expected)) / sum(c.numel() for c in codes)
    assert agree >= 0.99  # fp32 near-ties in the codebook search may flip a rare id


def test_properties():
    fast = FastSNAC.from_pretrained("synthetic:snac_32khz", device="cpu")
    assert fast.sampling_rate == 32000 and fast.hop_length == 384 and fast.n_levels == 4
    assert fast.config["decoder_dim"] == 1536 and fast.model.decoder is not None
    assert "snac_32khz" in repr(fast)


@pytest.fixture(scope="module")
def fast24():
    return FastSNAC.from_pretrained("synthetic:snac_24khz", device="cpu")


@pytest.mark.parametrize("codes, message", [
    (lambda c: c[:2], "3 code levels"),
    (lambda c: c[0], "not a single tensor"),
    (lambda c: "codes", "must be a list"),
    (lambda c: [c[0].float(), c[1], c[2]], "integer tensor"),
    (lambda c: [c[0][0], c[1], c[2]], r"shaped \[B, L\]"),
    (lambda c: [c[0], c[1], c[2].repeat(2, 1)], "batch sizes"),
    (lambda c: [c[0], c[1], c[2][:, :-1]], "do not follow vq_strides"),
    (lambda c: [c[0], c[1] - 5000, c[2]], "level 1 holds id -"),
    (lambda c: [c[0], c[1], c[2] + 4096], r"outside \[0, 4096\)"),
    (lambda c: [c[0][:, :0], c[1][:, :0], c[2][:, :0]], "do not follow"),
])
def test_decode_validation_errors(fast24, codes, message):
    good = random_codes(fast24.config, 2, seed=0)
    with pytest.raises(ValueError, match=message):
        fast24.decode(codes(good))


def test_attention_window_validation():
    fast = FastSNAC.from_pretrained("synthetic:snac_32khz", device="cpu")
    with pytest.raises(ValueError, match="multiple of 4 coarse frames"):
        fast.decode(random_codes(fast.config, 3))


@pytest.mark.parametrize("audio, message", [
    (torch.randn(1, 2, 100), r"\[B, 1, T\]"),
    (torch.randn(100), r"\[B, 1, T\]"),
    (torch.ones(1, 1, 100, dtype=torch.int16), "floating"),
    (torch.randn(1, 1, 0), "empty"),
    (torch.full((1, 1, 10), float("nan")), "NaN"),
    ([0.0, 1.0], "tensor"),
])
def test_encode_validation_errors(fast24, audio, message):
    with pytest.raises(ValueError, match=message):
        fast24.encode(audio)


def test_bad_dtype_and_device():
    model = synthetic_model("snac_24khz")
    with pytest.raises(ValueError, match="dtype"):
        FastSNAC(model, device="cpu", dtype=torch.int8)
    with pytest.raises(ValueError, match="dtype"):
        FastSNAC(model, device="cpu", dtype="float8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            FastSNAC(model, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", MODELS)
def test_gpu_fp32_decode_matches_upstream(cuda, name):
    fast = FastSNAC.from_pretrained(f"synthetic:{name}", device=cuda, dtype=torch.float32)
    ref = fast.reference_model()
    codes = random_codes(fast.config, 4 * coarse_frames(fast.config), batch=2, seed=2)
    out = fast.decode(codes, generator=torch.Generator().manual_seed(5))
    expected = decode_with_noise(ref, codes, 5, torch.device("cpu"))
    assert snr_db(expected, out) >= 100 and max_abs_error(expected, out) <= 1e-5  # the GPU's float32 math


def _fixed_noise(fast):
    """NoiseBlocks draw a fixed, traceable signal instead of fresh noise: compiled and eager decodes
    are then comparable."""
    for block in noise_blocks(fast.model):
        block.draw_noise = lambda x: torch.cos(torch.arange(x.shape[0] * x.shape[2], device=x.device, dtype=torch.float32)
                                               ).to(x.dtype).reshape(x.shape[0], 1, x.shape[2])


def _packed_weights(fast):
    return [m._packed[1] for m in fast.model.modules() if isinstance(m, FusedConvTranspose1d)]


def test_whole_decode_compiles_as_one_graph():
    """torch.compile traces a fused decode without a graph break and uses the transposed convs'
    weights packed at surgery, never packing or caching inside the graph (a tensor cached there
    lives in the graph's memory: under reduce-overhead the next replay overwrote it)."""
    torch._dynamo.reset()
    fast = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu", dtype=torch.float32)
    packed = _packed_weights(fast)
    assert len(packed) == 4 and all(p is not None for p in packed)
    _fixed_noise(fast)
    compiled = torch.compile(fast.model.decode, backend="aot_eager", fullgraph=True)
    with torch.inference_mode():
        for seed in range(2):
            codes = random_codes(fast.config, 2, seed=seed)
            torch.testing.assert_close(compiled(codes), fast.model.decode(codes))
    assert all(a is b for a, b in zip(_packed_weights(fast), packed))


@pytest.mark.gpu
def test_gpu_compile_reduce_overhead_matches_eager(cuda):
    """FastSNAC's decode under torch.compile(mode="reduce-overhead") (Inductor, CUDA graph trees),
    several calls with outputs kept (cloned), against the eager fused decode."""
    torch._dynamo.reset()
    fast = FastSNAC.from_pretrained("synthetic:snac_24khz", device=cuda, cuda_graphs=False)
    _fixed_noise(fast)
    compiled = torch.compile(fast.model.decode, mode="reduce-overhead")
    code_sets = [[c.to(cuda) for c in random_codes(fast.config, 4, seed=seed)] for seed in range(4)]
    with torch.inference_mode():
        got = [compiled(codes).clone() for codes in code_sets * 2]
        want = [fast.model.decode(codes) for codes in code_sets * 2]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-3, rtol=0)


def test_half_precision_attention_runs_in_half():
    """Upstream's 32/44 kHz attention fails in half precision (float32 rotary scale promotes q, k);
    snac-fast runs it as HalfLocalMHA (rotary in float32, rounded once), which in the decoder also
    applies the next block's snake."""
    codes = random_codes(published_config("snac_32khz"), 4, seed=2)
    plain = synthetic_model("snac_32khz", **NARROW).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="same dtype"):
        decode_with_noise(plain, codes, 0, torch.device("cpu"))
    fast = FastSNAC(synthetic_model("snac_32khz", **NARROW), device="cpu", dtype=torch.bfloat16)
    assert fast.report.half_attention == ["encoder.block.5", "decoder.model.2"]
    assert all(type(fast.model.get_submodule(n)) is HalfLocalMHA for n in fast.report.half_attention)
    attention, block = fast.model.decoder.model[2], fast.model.decoder.model[3]
    assert attention.to_qkv.weight.dtype == torch.bfloat16
    # block 1's input snake moved into the attention's output projection, which writes [B, T, C]
    conv = next(m for m in block.block if isinstance(m, FusedConvTranspose1d))
    assert conv.snake_in is None and attention.alpha_out is block.block[0].alpha and attention.channels_last_out
    assert block.block[0].absorbed_by == "decoder.model.2"
    out = fast.decode(codes, seed=0)
    assert out.dtype == torch.bfloat16
    expected = decode_with_keyed_noise(fast.reference_model(), codes, 0)  # the noise decode(seed=0) feeds
    # a loose floor, not the baseline rule: the interpreter rounds float32 to bfloat16 toward zero
    # (test_fidelity), so bfloat16 here is not the GPU's arithmetic; the gpu fidelity matrix holds the rule
    assert snr_db(expected, out) > 25
