"""snac_fast.streaming.layer_state: the CPU's step with state per layer against the stage engine and
whole decodes (float64, torch ops): the same audio at the same pushes, rows at any positions in one
step, both ends' zero padding, the attention's windows and the 32 kHz model's stride 3."""

import random

import pytest
import torch
from helpers import NARROW, engine64, frames_of, random_codes, upstream64

from snac_fast import FastSNAC
from snac_fast.configs import published_config
from snac_fast.model.noise import decode_with_keyed_noise
from snac_fast.model.synthetic import synthetic_model
from snac_fast.ops.noise import keyed_normal, keyed_normal_at
from snac_fast.streaming import StreamEngine

MODELS = ["snac_24khz", "snac_32khz", "snac_44khz"]


@pytest.mark.parametrize("name", MODELS)
def test_every_push_gives_what_the_stage_engine_gives(name):
    """Random pushes (whole attention groups), then the flush: each piece has the stage engine's
    length and values (float64), so the lookahead, first audio and prefill promises hold unchanged."""
    narrow = name != "snac_24khz"
    config = {**published_config(name), **(NARROW if narrow else {})}
    layered, stages = engine64(name, narrow=narrow, layered=True), engine64(name, narrow=narrow, layered=False)
    assert layered.layered is not None and stages.layered is None
    g, strides = layered.frames_per_group, config["vq_strides"]
    rng = random.Random(name)
    frames = layered.prefill_frames + 5 * g
    codes = random_codes(config, frames, seed=7)
    a, b = layered.open(3), stages.open(3)
    f = 0
    while f < frames:
        k = min(frames - f, g * rng.randint(1, 3))
        got, want = layered.advance({a: frames_of(codes, strides, f, f + k)})[a], stages.advance({b: frames_of(codes, strides, f, f + k)})[b]
        assert got.shape == want.shape, f"push at frame {f}: {got.shape[0]} samples, the stages give {want.shape[0]}"
        assert got.numel() == 0 or (got - want).abs().max().item() < 1e-12
        f += k
    got, want = layered.advance(finish=[a])[a], stages.advance(finish=[b])[b]
    assert got.shape == want.shape == (layered.lookahead_samples,)
    assert (got - want).abs().max().item() < 1e-12


def test_rows_at_different_positions_step_together_and_slots_are_reused():
    """Streams opened at different times (so at different positions) share steps; a slot freed by a
    finished stream and taken by a new one starts from zero state (its prefill does not read the old)."""
    name = "snac_24khz"
    config = published_config(name)
    strides = config["vq_strides"]
    engine = engine64(name, streams=3)
    frames = 12
    codes = random_codes(config, frames, batch=3, seed=2)
    expected = decode_with_keyed_noise(upstream64(name), codes, 5)
    first = engine.open(5, row=0)
    pieces = {0: [engine.advance({first: frames_of(codes, strides, 0, 6, row=0)})[first]]}
    # a stream that ends early leaves its slot dirty for the next
    early = engine.open(99, row=9)
    engine.advance({early: frames_of(codes, strides, 0, 7, row=1)})
    engine.advance(finish=[early])
    others = [engine.open(5, row=b) for b in (1, 2)]
    assert early.slot in {s.slot for s in others}
    for b, s in zip((1, 2), others):
        pieces[b] = [engine.advance({s: frames_of(codes, strides, 0, 4, row=b)})[s]]
    streams, at = [first] + others, [6, 4, 4]
    while min(at) < frames:  # one frame for every stream per call: rows at frames 6, 4, 4 and on
        pushes = {s: frames_of(codes, strides, f, f + 1, row=b) for b, (s, f) in enumerate(zip(streams, at)) if f < frames}
        for s, audio in engine.advance(pushes).items():
            pieces[streams.index(s)].append(audio)
        at = [min(frames, f + 1) for f in at]
    for b, audio in engine.advance(finish=streams).items():
        pieces[streams.index(b)].append(audio)
    for b in range(3):
        got = torch.cat(pieces[b])
        assert got.shape == expected[b, 0].shape and (got - expected[b, 0]).abs().max().item() < 1e-12, f"row {b}"


@pytest.mark.parametrize("name", ["snac_24khz", "snac_32khz"])
def test_a_flush_right_after_the_prefill_and_a_one_step_stream(name):
    narrow = name != "snac_24khz"
    config = {**published_config(name), **(NARROW if narrow else {})}
    engine = engine64(name, narrow=narrow)
    g, strides = engine.frames_per_group, config["vq_strides"]
    for frames in (engine.prefill_frames, engine.prefill_frames + g):
        codes = random_codes(config, frames, seed=frames)
        s = engine.open(1)
        got = torch.cat([engine.advance({s: frames_of(codes, strides, 0, frames)})[s], engine.advance(finish=[s])[s]])
        expected = decode_with_keyed_noise(upstream64(name, narrow), codes, 1)[0, 0]
        assert got.shape == expected.shape and (got - expected).abs().max().item() < 1e-12


def test_the_fused_float32_model_on_a_cpu_streams_per_layer_and_equals_its_decode():
    """FastSNAC's own tree (absorbed layers read as what they compute) in float32: the default CPU
    stream is the per-layer one and equals the decode to float32 rounding (>= 100 dB)."""
    codec = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu", dtype=torch.float32)
    stream = codec.stream(seed=4)
    assert stream.engine.layered is not None
    strides = codec.config["vq_strides"]
    codes = random_codes(codec.config, 9, seed=1)
    pieces = [stream.push(frames_of(codes, strides, f, f + 1)) for f in range(9)] + [stream.flush()]
    expected = codec.decode(codes, seed=4)[0, 0]
    got = torch.cat(pieces)
    error = (got - expected).double()
    assert got.shape == expected.shape
    assert 10 * torch.log10(expected.double().pow(2).sum() / error.pow(2).sum()) >= 100


@pytest.mark.heavy
def test_a_compiled_step_equals_the_eager_one():
    """compile=True: steps through torch.compile (inductor's C++), prefill and flush eager; the same
    audio as the eager engine to float32 rounding, two rows."""
    codec = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu", dtype=torch.float32)
    strides = codec.config["vq_strides"]
    codes = random_codes(codec.config, 7, batch=2, seed=5)
    out = []
    for compile in (False, True):
        engine = codec.stream_engine(2, compile=compile)
        streams = [engine.open(seed=8, row=b) for b in range(2)]
        pieces = [engine.step(streams, [c[:, f * strides[0] // s:(f + 1) * strides[0] // s] for c, s in zip(codes, strides)])
                  for f in range(7)]
        ends = engine.advance(finish=streams)
        out.append(torch.stack([torch.cat([p[b] for p in pieces] + [ends[s]]) for b, s in enumerate(streams)]))
    assert out[0].shape == out[1].shape
    assert (out[0] - out[1]).abs().max().item() <= 1e-5 * out[0].abs().max().item()
    with pytest.raises(ValueError, match="compile=True"):
        codec.stream_engine(1, compile=True, lookahead=2048)


def test_which_engines_stream_per_layer():
    """A CPU's exact float32/float64 streams do; approximate ones, half dtypes and CUDA graphs do not."""
    assert engine64("snac_24khz").layered is not None
    assert engine64("snac_24khz", lookahead=2048).layered is None
    model = upstream64("snac_24khz")
    config = published_config("snac_24khz")
    assert StreamEngine(model, config, 1, dtype=torch.bfloat16).layered is None
    with pytest.raises(ValueError, match="exact streams"):
        engine64("snac_24khz", lookahead=2048, layered=True)
    engine = engine64("snac_24khz", streams=2)
    per_layer = sum(t[0].numel() for t in engine.state)
    assert engine.state_bytes_per_stream == per_layer * 8 and per_layer > 0


def test_a_calls_new_states_hold_no_layers_whole_input():
    """What a call keeps of each layer is a copy of its span: a view would hold the layer's whole
    input buffer (the span and the push) until the call's end, most of a CPU call's live memory."""
    engine = engine64("snac_24khz", streams=2)
    layers = engine.layered
    keys = torch.tensor([[0], [0], [1], [0]], dtype=torch.int64)
    latent = torch.randn(1, layers.channels, 4 * layers.latent_per_frame, dtype=torch.float64)
    _, states = layers._run(latent.transpose(1, 2).contiguous(), layers._fresh_states(1), keys, "prefill")
    assert len(states) == len(layers.states)
    for state in states:
        assert state.untyped_storage().nbytes() == state.numel() * state.element_size()


def test_noise_of_several_blocks_in_one_pass_is_each_blocks_noise():
    seeds, rows = torch.tensor([3, -2**62], dtype=torch.int64), torch.tensor([0, 7])
    frames = torch.tensor([5, 0])
    calls = [(2048, -100, 300, 0), (256, -13, 40, 3)]
    positions = torch.cat([frames[:, None] * per + start + torch.arange(n) for per, start, n, _ in calls], 1)
    blocks = torch.cat([torch.full((n,), block) for _, _, n, block in calls])
    got = keyed_normal_at(seeds, rows, positions, blocks)
    want = torch.cat([keyed_normal(seeds, rows, frames, per, start, n, block)[:, 0] for per, start, n, block in calls], 1)
    assert got.shape == (2, 340) and (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("name, frames, batch", [("snac_24khz", 37, 1), ("snac_24khz", 9, 2), ("snac_32khz", 16, 2)])
def test_a_cpu_decode_runs_through_the_layers_and_equals_upstream(name, frames, batch):
    """FastSNAC.decode on a CPU in float32, 8 frames or more: through the layers (a prefill, steps of
    a few frames, the flush), equal to upstream's own decode with the same keyed noise (>= 100 dB per
    row); 37 frames take several steps, 9 frames of two rows one step of each."""
    from snac_fast.metrics import snr_db

    codec = FastSNAC(synthetic_model(name, **NARROW), device="cpu", dtype=torch.float32)
    codes = random_codes(codec.config, frames, batch=batch, seed=frames)
    calls = []
    layers = codec._layer_decoder()
    decode = layers.decode
    layers.decode = lambda *a: calls.append(1) or decode(*a)
    got = codec.decode(codes, seed=21)
    assert calls and got.shape == (batch, 1, codec.latent_length(codes) * codec.hop_length)
    want = decode_with_keyed_noise(codec.reference_model(), codes, 21)
    for b in range(batch):
        assert snr_db(want[b, 0], got[b, 0]) >= 100, f"row {b}"
    fresh = codec.decode(codes), codec.decode(codes)  # no seed: fresh noise each call, as upstream
    assert (fresh[0] - fresh[1]).abs().max() > 0
    torch.manual_seed(4)
    again = codec.decode(codes)
    torch.manual_seed(4)
    assert torch.equal(codec.decode(codes), again)  # torch's generator repeats it, as upstream's randn


def test_a_short_cpu_decode_keeps_the_module_tree():
    codec = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu", dtype=torch.float32)
    layers = codec._layer_decoder()
    layers.decode = lambda *a: pytest.fail("a 4-frame decode went through the layers")
    codes = random_codes(codec.config, 4, seed=1)
    assert codec.decode(codes, seed=3).shape == (1, 1, 4 * codec.hop_length * codec.config["vq_strides"][0])


def test_the_layers_follow_a_weight_changed_in_place():
    """The layers copy some weights (the transposed convs' phase layout): a weight changed after a
    decode (in place, as fine-tuning or a perturbation does) is in the next decode and the next step."""
    from snac_fast.metrics import snr_db

    codec = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu", dtype=torch.float32)
    codes = random_codes(codec.config, 9, seed=3)
    before = codec.decode(codes, seed=1)
    engine = codec.stream_engine(1)
    with torch.no_grad():
        codec.model.decoder.model[2].block[1].weight.mul_(1.5)  # block 1's transposed conv
    after = codec.decode(codes, seed=1)
    layers = codec._layer_decoder
    codec._layer_decoder = lambda: None  # the module tree's own decode of the changed weights
    tree = codec.decode(codes, seed=1)
    codec._layer_decoder = layers
    assert snr_db(tree[0, 0], before[0, 0]) < 40 and snr_db(tree[0, 0], after[0, 0]) >= 100
    s = engine.open(1)
    strides = codec.config["vq_strides"]
    streamed = torch.cat([engine.advance({s: frames_of(codes, strides, 0, 9)})[s], engine.advance(finish=[s])[s]])
    assert snr_db(tree[0, 0], streamed) >= 100
