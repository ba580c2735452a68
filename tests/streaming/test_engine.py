"""snac_fast.streaming: exact against whole decodes, batched streams, token layouts, lookahead, warm-up.

The broad randomized checks run the engine over upstream's own float64 model (the same stage
geometry; torch ops, fast on the CPU): a stream must equal the whole decode to float64 rounding.
The fused kernels (Triton's interpreter) are checked end to end in float32 on fewer frames.
"""

import os
import random
import subprocess
import sys

import pytest
import torch
from helpers import NARROW, engine64, frames_of, random_codes, upstream64

from snac_fast import FastSNAC
from snac_fast.batching.defaults import ROWS_PER_PASS
from snac_fast.configs import published_config
from snac_fast.metrics import snr_db
from snac_fast.model.noise import decode_with_keyed_noise
from snac_fast.model.synthetic import synthetic_model
from snac_fast.orpheus import ORPHEUS
from snac_fast.streaming import DecoderStream, StreamEngine
from snac_fast.streaming.lookahead import FP16_LOOKAHEAD
from snac_fast.streaming.shapes import bucket_rows, warmup_buckets

MODELS = ["snac_24khz", "snac_32khz", "snac_44khz"]


def stream_through(engine, slot, codes, strides, splits):
    pieces, f = [], 0
    for k in splits:
        pieces.append(engine.advance({slot: frames_of(codes, strides, f, f + k)})[slot])
        f += k
    pieces.append(engine.advance(finish=[slot])[slot])
    return torch.cat(pieces)


def random_splits(total, group, rng):
    splits = []
    while sum(splits) < total:
        splits.append(min(total - sum(splits), group * rng.randint(1, 5)))
    return splits


def test_seeded_decode_rows_are_keyed_streams():
    """decode(seed) of a batch: row b has the noise of key (seed, b), so each row equals a B=1 decode with row b."""
    model = upstream64("snac_24khz")
    codes = random_codes(published_config("snac_24khz"), 3, batch=2, seed=4)
    both = decode_with_keyed_noise(model, codes, 9)
    engine = engine64("snac_24khz")
    for b in range(2):
        slot = engine.open(9, row=b)
        alone = stream_through(engine, slot, [c[b:b + 1] for c in codes], published_config("snac_24khz")["vq_strides"], [3])
        assert (alone - both[b, 0]).abs().max().item() < 1e-12


# --- exact streams ----------------------------------------------------------------------------

@pytest.mark.heavy
@pytest.mark.parametrize("layered", [True, False], ids=["state per layer", "stages"])
@pytest.mark.parametrize("name", MODELS)
def test_stream_equals_whole_decode_float64(name, layered):
    """The 44 kHz network is the 32 kHz one (only the sampling rate differs): it runs narrow. Both
    step forms: state per layer (a CPU's default) and the stages (a GPU's)."""
    rng = random.Random(name)
    narrow = name == "snac_44khz"
    engine = engine64(name, narrow=narrow, layered=layered)
    assert (engine.layered is not None) == layered
    config = published_config(name)
    g, strides = engine.frames_per_group, config["vq_strides"]
    assert engine.lookahead_samples > 0 and engine.lookahead_ms == pytest.approx(1000 * engine.lookahead_samples / config["sampling_rate"])
    for trial in range(2):
        frames = engine.prefill_frames + g * rng.randint(1, 4)
        codes = random_codes(config, frames, seed=trial)
        expected = decode_with_keyed_noise(upstream64(name, narrow), codes, trial)[0, 0]
        got = stream_through(engine, engine.open(trial), codes, strides, random_splits(frames, g, rng))
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() < 1e-12, f"{name} trial {trial}: not the whole decode"


@pytest.mark.parametrize("layered", [True, False], ids=["state per layer", "stages"])
@pytest.mark.parametrize("name", ["snac_24khz", "snac_32khz"])
def test_batched_step_equals_whole_decode_rows(name, layered):
    """engine.step: every stream's codes in one tensor per level; rows keyed like decode's rows;
    pushes bigger than a step, pending codes that outgrow the buffer, bad ids refused first. The
    32 kHz model runs narrow (helpers.NARROW): what is checked is the engine's bookkeeping."""
    narrow = name == "snac_32khz"
    config = published_config(name)
    engine = engine64(name, streams=5, narrow=narrow, max_frames_per_step=2, layered=layered)
    engine.pending = engine.schedule.pending = type(engine.pending)(5, engine.pending.ratios, capacity=3)  # moves, growth
    g, strides = engine.frames_per_group, config["vq_strides"]
    frames = engine.prefill_frames + 3 * g
    codes = random_codes(config, frames, batch=3, seed=4)
    expected = decode_with_keyed_noise(upstream64(name, narrow), codes, 11)
    streams = [engine.open(11, row=b) for b in range(3)]
    pieces, f = [[] for _ in streams], 0
    for k in [g, frames - 2 * g, g]:  # the middle push: prefill and steps in one call, past the buffer's capacity
        for piece, audio in zip(pieces, engine.step(streams, frames_of_rows(codes, strides, f, f + k))):
            piece.append(audio)
        f += k
    bad = frames_of_rows(codes, strides, 0, g)
    bad[-1] = bad[-1].clone()
    bad[-1][2, 0] = config["codebook_size"]
    with pytest.raises(ValueError, match="outside"):
        engine.step(streams, bad)
    with pytest.raises(ValueError, match="rows"):
        engine.step(streams[:2], frames_of_rows(codes, strides, 0, g))
    with pytest.raises(ValueError, match="twice"):
        engine.step([streams[0]] * 3, frames_of_rows(codes, strides, 0, g))
    ends = engine.advance(finish=streams)
    for b, s in enumerate(streams):
        got = torch.cat(pieces[b] + [ends[s]])
        assert got.shape == expected[b, 0].shape
        assert (got - expected[b, 0]).abs().max().item() < 1e-12


@pytest.mark.parametrize("name, layered", [("snac_24khz", True), ("snac_24khz", False), ("snac_32khz", True)],
                         ids=["24khz state per layer", "24khz stages", "32khz state per layer"])
def test_a_cpu_engines_calls_hold_at_most_max_call_frames(name, layered):
    """A round of prefills, multi-frame steps and flushes of 3 streams runs in calls of at most
    max_call_frames stream-frames (a CPU's default: CPU_CALL_FRAMES, a prefill at least), every
    stream still its whole decode; an unbounded engine runs the same round in bigger calls."""
    from snac_fast.streaming.schedule import CPU_CALL_FRAMES
    from snac_fast.streaming.shapes import FLUSH

    narrow = True  # the bookkeeping is what is checked
    config = {**published_config(name), **NARROW}
    strides = config["vq_strides"]
    bounded = engine64(name, streams=3, narrow=narrow, layered=layered)
    unbounded = engine64(name, streams=3, narrow=narrow, layered=layered, max_call_frames=10**6)
    cap = bounded.max_call_frames
    assert cap == max(CPU_CALL_FRAMES, bounded.prefill_frames)
    g = bounded.frames_per_group
    frames = bounded.prefill_frames + 2 * g
    codes = random_codes(config, frames, batch=3, seed=5)
    expected = decode_with_keyed_noise(upstream64(name, narrow), codes, 3)
    largest = {}
    for engine in (bounded, unbounded):
        calls = []
        run = engine.steps.run

        def counted(kind, keys, c, n_frames, n, run=run, calls=calls):
            calls.append(n * (engine.prefill_frames if kind == FLUSH else n_frames))
            return run(kind, keys, c, n_frames, n)

        engine.steps.run = counted
        streams = [engine.open(3, row=b) for b in range(3)]
        pieces = [[] for _ in streams]
        f = 0
        for k in [engine.prefill_frames, 2 * g]:  # the prefills, then a 2-group step of every stream
            for piece, audio in zip(pieces, engine.step(streams, frames_of_rows(codes, strides, f, f + k))):
                piece.append(audio)
            f += k
        ends = engine.advance(finish=streams)
        for b, s in enumerate(streams):
            got = torch.cat(pieces[b] + [ends[s]])
            assert (got - expected[b, 0]).abs().max().item() < 1e-12
        largest[engine is bounded] = max(calls)
    assert largest[True] <= cap < largest[False]
    with pytest.raises(ValueError, match="max_call_frames"):
        engine64(name, narrow=narrow, max_call_frames=bounded.prefill_frames - 1)


def test_after_a_warm_up_only_warmed_step_shapes_run():
    """A warm-up fixes the step shapes: pushes of more frames than a warmed step then run as
    one-group steps (no graph captured while streams wait), with the same audio. The warm-up's
    record is set by hand here (the CPU captures no graphs)."""
    config = published_config("snac_24khz")
    engine = engine64("snac_24khz", streams=3)
    engine.steps.warmed = {("step", b, 1) for b in (1, 2, 3)} | {("step", 2, 2)}
    ran = []
    run = engine.steps.run
    engine.steps.run = lambda kind, keys, codes, frames, n: ran.append((kind, n, frames)) or run(kind, keys, codes, frames, n)
    strides = config["vq_strides"]
    frames = engine.prefill_frames + 9
    codes = random_codes(config, frames, batch=2, seed=12)
    streams = [engine.open(5, row=b) for b in range(2)]
    pieces, f = [], 0
    for k in [engine.prefill_frames, 2, 4, 3]:
        pieces.append(engine.step(streams, frames_of_rows(codes, strides, f, f + k)))
        f += k
    ends = engine.advance(finish=streams)
    steps = [r for r in ran if r[0] == "step"]
    # 2 frames: one warmed step; 4: 1 + 2 + 1 (a 4-frame step is not warmed, the 2-frame one is); 3: 2 + 1
    assert [k for _, _, k in steps] == [2, 1, 2, 1, 2, 1] and {n for _, n, _ in steps} == {2}, steps
    expected = decode_with_keyed_noise(upstream64("snac_24khz"), codes, 5)
    for b, s in enumerate(streams):
        got = torch.cat([p[b] for p in pieces] + [ends[s]])
        assert (got - expected[b, 0]).abs().max().item() < 1e-12


def steps_around_a_close(engine, config, decode):
    """Three streams stepped together, one closed in between: the closed one is refused even
    though its batch was stepped before; the others go on in another order and stay exact."""
    strides = config["vq_strides"]
    frames = engine.prefill_frames + 5
    codes = random_codes(config, frames, batch=3, seed=6)
    streams = [engine.open(seed=7, row=b) for b in range(3)]
    pieces = [engine.step(streams, frames_of_rows(codes, strides, 0, engine.prefill_frames))]
    for f in range(engine.prefill_frames, engine.prefill_frames + 3):
        pieces.append(engine.step(streams, frames_of_rows(codes, strides, f, f + 1)))
    engine.close(streams[1])
    f = engine.prefill_frames + 3
    with pytest.raises(ValueError, match="closed"):
        engine.step(streams, frames_of_rows(codes, strides, f, f + 1))
    other = StreamEngine(engine.model, config, 2, device=engine.device, dtype=engine.dtype).open(7)
    with pytest.raises(ValueError, match="another engine"):
        engine.step([streams[0], other], [c[:2] for c in frames_of_rows(codes, strides, f, f + 1)])
    kept = [2, 0]
    for f in range(f, frames):
        rows = [c[kept] for c in frames_of_rows(codes, strides, f, f + 1)]
        pieces.append(dict(zip(kept, engine.step([streams[b] for b in kept], rows))))
    ends = engine.advance(finish=[streams[b] for b in kept])
    expected = decode(codes, 7)
    for b in kept:
        got = torch.cat([p[b] for p in pieces] + [ends[streams[b]]])
        assert got.shape == expected[b, 0].shape
        yield expected[b, 0], got


def test_step_rechecks_its_streams_after_a_close():
    name = "snac_24khz"
    config = published_config(name)
    for expected, got in steps_around_a_close(engine64(name, streams=4), config,
                                              lambda codes, seed: decode_with_keyed_noise(upstream64(name), codes, seed)):
        assert (got - expected).abs().max().item() < 1e-12


@pytest.mark.gpu
def test_gpu_step_rechecks_its_streams_after_a_close(cuda, no_tf32):
    """The same with CUDA graphs: the batch's cached key rows, the frames consumed filled per call."""
    fast = FastSNAC.from_pretrained("synthetic:snac_24khz", device=cuda, dtype=torch.float32)
    engine = fast.stream_engine(4)
    for expected, got in steps_around_a_close(engine, fast.config, lambda codes, seed: fast.decode(codes, seed=seed)):
        assert snr_db(expected, got) >= 100
    assert ("step", 4, 1) in engine.steps.graphs and ("step", 2, 1) in engine.steps.graphs


def frames_of_rows(codes, strides, start, stop):
    return [c[:, start * strides[0] // s:stop * strides[0] // s] for c, s in zip(codes, strides)]


def test_many_streams_open_close_and_interleave():
    name = "snac_24khz"
    config, strides = published_config(name), published_config(name)["vq_strides"]
    engine = engine64(name, streams=3)
    rng = random.Random(1)
    lengths = [9, 5, 2, 7, 6]  # 2: ends before its prefill (decoded whole)
    codes = [random_codes(config, n, seed=10 + i) for i, n in enumerate(lengths)]
    expected = [decode_with_keyed_noise(upstream64(name), c, 100 + i)[0, 0] for i, c in enumerate(codes)]
    open_, got, position, waiting = {}, {i: [] for i in range(5)}, {}, list(range(5))
    while waiting or open_:
        while waiting and engine.open_streams < 3:  # open streams as slots free up
            i = waiting.pop(0)
            open_[i] = engine.open(100 + i)
            position[i] = 0
        pushes, finish = {}, []
        for i, slot in list(open_.items()):
            if position[i] == lengths[i]:
                finish.append(slot)
                continue
            if rng.random() < 0.7:
                k = min(lengths[i] - position[i], rng.randint(1, 3))
                pushes[slot] = frames_of(codes[i], strides, position[i], position[i] + k)
                position[i] += k
        audio = engine.advance(pushes, finish)
        for i, slot in list(open_.items()):
            if slot in audio:
                got[i].append(audio[slot])
            if slot in finish:
                del open_[i]
    for i in range(5):
        assert (torch.cat(got[i]) - expected[i]).abs().max().item() < 1e-12, f"stream {i}"
    assert engine.open_streams == 0


@pytest.mark.parametrize("layered", [True, False], ids=["state per layer", "stages"])
@pytest.mark.parametrize("name", ["snac_24khz", "snac_32khz"])
def test_fast_stream_equals_fast_decode(name, layered):
    """The fused kernels (interpreter on the CPU), float32: stream vs whole decode, same seed, in both
    step forms (the stages run the GPU's kernels). The models run narrow (helpers.NARROW): the same
    structure and stream arithmetic in a fraction of the interpreter's time (full-width kernels:
    tests/ops, test_reference, and the gpu tests)."""
    fast = FastSNAC(synthetic_model(name, **NARROW), device="cpu", dtype=torch.float32)
    stream = DecoderStream(fast.stream_engine(1, layered=layered), seed=11)
    g, strides = stream.engine.frames_per_group, fast.config["vq_strides"]
    frames = stream.engine.prefill_frames + g
    codes = random_codes(fast.config, frames, seed=2)
    expected = fast.decode(codes, seed=11)[0, 0]
    pieces = [stream.push(frames_of(codes, strides, 0, stream.engine.prefill_frames - g)),
              stream.push(frames_of(codes, strides, stream.engine.prefill_frames - g, frames)),  # prefill, then a step
              stream.flush()]
    assert pieces[0].numel() == 0 and pieces[1].numel() > 0
    snr = snr_db(expected, torch.cat(pieces))
    print(f"{name}: stream vs decode {snr:.1f} dB")
    assert snr >= 100


def test_half_stream_with_half_attention_is_as_faithful_as_half_decode():
    """32 kHz in bfloat16 (HalfLocalMHA in the attention stage, kernels through the interpreter):
    the stream is about as close to the float32 decode as the bfloat16 decode is (within 1.5 dB)."""
    name, seed = "snac_32khz", 5
    half = FastSNAC(synthetic_model(name, **NARROW), device="cpu", dtype=torch.bfloat16)
    assert half.report.half_attention
    full = FastSNAC(synthetic_model(name, **NARROW), device="cpu", dtype=torch.float32)
    stream = half.stream(seed=seed)
    g, strides = stream.engine.frames_per_group, half.config["vq_strides"]
    frames = stream.engine.prefill_frames + 2 * g
    codes = random_codes(half.config, frames, seed=3)
    reference = full.decode(codes, seed=seed)[0, 0].float()
    pieces = [stream.push(frames_of(codes, strides, 0, stream.engine.prefill_frames)),
              stream.push(frames_of(codes, strides, stream.engine.prefill_frames, frames)), stream.flush()]
    streamed = snr_db(reference, torch.cat(pieces).float())
    decoded = snr_db(reference, half.decode(codes, seed=seed)[0, 0].float())
    print(f"bf16 stream {streamed:.1f} dB, bf16 decode {decoded:.1f} dB against float32")
    # measured: stream 25.4 dB, decode 26.4 (26.1 before the NoiseBlock bias fold: the decode's
    # cuDNN-sized transposed convs leave their bias to the NoiseBlock, which adds it in float32;
    # the stream's short steps add it to the half output, as upstream does)
    assert streamed >= decoded - 1.5 and decoded > 25


def approximate_reference(name, codes, strides, splits, lookahead, per_frame, seed=1, narrow=True):
    """What an approximate stream must emit, built from whole decodes: after each push, the decode
    of every code so far up to ``lookahead`` samples before its end (from where the last push's
    output stopped); the flush, the rest of the whole decode."""
    pieces, emitted, f = [], 0, 0
    for k in splits:
        f += k
        prefix = decode_with_keyed_noise(upstream64(name, narrow), frames_of(codes, strides, 0, f), seed)[0, 0]
        end = max(emitted, f * per_frame - lookahead)
        pieces.append(prefix[emitted:end])
        emitted = end
    pieces.append(decode_with_keyed_noise(upstream64(name, narrow), codes, seed)[0, 0][emitted:])
    return pieces


@pytest.mark.parametrize("name, lookahead", [("snac_24khz", 0), ("snac_24khz", 2048), ("snac_24khz", 3000),
                                             ("snac_32khz", 0), ("snac_32khz", 6144), ("snac_44khz", 1024)])
def test_approximate_stream_is_a_window_decode_with_all_left_context(name, lookahead):
    """Below the exact lookahead a stream emits, at each push, the decode of all its codes so far
    up to ``lookahead`` samples before their end (zero-padded there, as a whole decode pads), and
    never revises it: equal to that construction from whole decodes to float64 rounding, over
    pushes of one group and of several frames at once (where its exact audio is emitted too)."""
    config, strides = {**published_config(name), **NARROW}, published_config(name)["vq_strides"]
    engine = engine64(name, streams=2, narrow=True, lookahead=lookahead)
    g, per_frame = engine.frames_per_group, engine.samples_per_frame
    assert engine.lookahead_samples == lookahead < engine.exact_lookahead_samples
    splits = [g, g, 3 * g, g, 4 * g, g]
    codes = random_codes(config, sum(splits), seed=7)
    slot = engine.open(1)
    want = approximate_reference(name, codes, strides, splits, lookahead, per_frame)
    got, f = [], 0
    for k in splits:
        got.append(engine.advance({slot: frames_of(codes, strides, f, f + k)})[slot])
        f += k
    got.append(engine.advance(finish=[slot])[slot])
    assert [len(p) for p in got] == [len(p) for p in want]
    first = next(i for i, p in enumerate(got) if len(p))
    assert sum(splits[:first + 1]) == engine.first_audio_frames or (first and sum(splits[:first]) < engine.first_audio_frames)
    torch.testing.assert_close(torch.cat(got), torch.cat(want), rtol=0, atol=1e-10)


def test_approximate_stream_fidelity_and_first_audio():
    """24 kHz, one frame per push: two frames of lookahead (4,096 samples, 171 ms) reach 80 dB of the
    whole decode and first audio after 3 frames (exact: 5,124 samples, after 4); no lookahead gives
    first audio after one frame; the emitted audio always trails the codes by the lookahead."""
    name = "snac_24khz"
    config, strides = published_config(name), published_config(name)["vq_strides"]
    codes = random_codes(config, 16, seed=3)
    expected = decode_with_keyed_noise(upstream64(name), codes, 1)[0, 0]
    for lookahead, first_frames, floor in [(4096, 3, 78), (0, 1, 15)]:
        engine = engine64(name, lookahead=lookahead)
        assert engine.first_audio_frames == first_frames and engine.first_audio_ms == pytest.approx(first_frames * 2048 / 24)
        slot, emitted = engine.open(1), 0
        pieces = []
        for f in range(16):
            pieces.append(engine.advance({slot: frames_of(codes, strides, f, f + 1)})[slot])
            emitted += len(pieces[-1])
            assert emitted == max(0, (f + 1) * 2048 - lookahead)
            assert (emitted > 0) == (f + 1 >= first_frames)
        pieces.append(engine.advance(finish=[slot])[slot])
        got = torch.cat(pieces)
        assert got.shape == expected.shape and snr_db(expected, got) > floor
    assert engine64(name).first_audio_frames == engine64(name).prefill_frames == 4
    for bad in (-1, 5125, 1.5, True, "fast"):
        with pytest.raises(ValueError, match="lookahead"):
            engine64(name, lookahead=bad)
    preset = engine64(name, lookahead="fp16")
    assert preset.lookahead_samples == FP16_LOOKAHEAD[24000] < 5124 and preset.first_audio_frames == 2
    assert engine64(name, lookahead="exact").approximate_lookahead is None
    assert engine64(name, lookahead=5124).approximate_lookahead is None  # the exact lookahead: the exact stream


def test_approximate_streams_batched_through_step_and_step_rows():
    """The batched entry points of an approximate engine (what the batchers call) emit what each
    stream would alone: streams at different points (one not yet started) in one call."""
    name = "snac_24khz"
    config, strides = {**published_config(name), **NARROW}, published_config(name)["vq_strides"]
    lookahead = 1500
    solo, batched = (engine64(name, streams=4, narrow=True, lookahead=lookahead) for _ in range(2))
    codes = [random_codes(config, 6, seed=s) for s in range(3)]
    alone = {i: [] for i in range(3)}
    together = {i: [] for i in range(3)}
    solo_slots = [solo.open(i) for i in range(3)]
    slots = [batched.open(i) for i in range(3)]
    for f in range(6):
        active = [i for i in range(3) if f >= i]  # stream i starts i frames late
        for i in active:
            alone[i].append(solo.advance({solo_slots[i]: frames_of(codes[i], strides, f - i, f - i + 1)})[solo_slots[i]])
        if f % 2:
            rows = torch.stack([torch.cat([c[0] for c in frames_of(codes[i], strides, f - i, f - i + 1)]) for i in active])
            audio, offsets = batched.step_rows([slots[i] for i in active], rows.numpy(), 1)
            out = [audio[offsets[j]:offsets[j + 1]] for j in range(len(active))]
        else:
            out = batched.step([slots[i] for i in active],
                               [torch.cat([frames_of(codes[i], strides, f - i, f - i + 1)[lv] for i in active])
                                for lv in range(len(strides))])
        for i, piece in zip(active, out):
            together[i].append(piece)
    for i in range(3):
        assert [len(p) for p in together[i]] == [len(p) for p in alone[i]]
        torch.testing.assert_close(torch.cat(together[i]), torch.cat(alone[i]), rtol=0, atol=1e-12)


def test_stream_input_errors():
    name = "snac_32khz"
    engine = engine64(name)
    config = published_config(name)
    slot = engine.open(0)
    good = random_codes(config, 4, seed=0)
    with pytest.raises(ValueError, match="4 code levels"):
        engine.advance({slot: good[:3]})
    with pytest.raises(ValueError, match="do not follow vq_strides"):
        engine.advance({slot: [good[0], good[1], good[2], good[3][:, :-1]]})
    bad = [c.clone() for c in good]
    bad[2][0, 3] = 4096
    with pytest.raises(ValueError, match="level 2 holds id 4096"):
        engine.advance({slot: bad})
    engine.advance({slot: random_codes(config, 2, seed=1)})  # half a group: held
    with pytest.raises(ValueError, match="multiple of 4 frames"):
        engine.advance(finish=[slot])
    engine.close(slot)
    with pytest.raises(ValueError, match="closed"):
        engine.advance({slot: good})
    small = engine64(name, streams=1)
    small.open()
    with pytest.raises(RuntimeError, match="all 1 stream slots"):
        small.open()
    with pytest.raises(ValueError, match="seed must be an integer"):
        engine.open(seed=1.5)


@pytest.mark.parametrize("name", ["snac_24khz", "snac_32khz"])
def test_step_sizes_scalar_and_vectorised_agree(name):
    """A step takes the largest power-of-two number of groups a stream holds, capped by
    max_frames_per_step; the per-call (scalar) rule and the per-batch (numpy) rule agree."""
    import numpy as np

    engine = engine64(name, max_frames_per_step=12)
    group = engine.frames_per_group
    held = np.arange(-2, 40)
    vectorised = engine.steps.step_frames_of(held)
    for pending, frames in zip(held.tolist(), vectorised.tolist()):
        assert engine.steps.step_frames(pending) == frames
        groups = min(pending, engine.max_frames_per_step) // group
        assert frames == (0 if groups < 1 else group * 2 ** int(np.log2(groups)))


# --- token layouts ----------------------------------------------------------------------------


def test_stream_accepts_token_ids():
    config = published_config("snac_24khz")
    codes = random_codes(config, 6, seed=5)
    expected = decode_with_keyed_noise(upstream64("snac_24khz"), codes, 4)[0, 0]

    stream = DecoderStream(engine64("snac_24khz"), 4, layout=ORPHEUS)
    ids, pieces, i = ORPHEUS.codes_to_ids(codes), [], 0
    for n in (3, 11, 1, 9, 18):  # cuts inside frames
        pieces.append(stream.push_ids(ids[i:i + n]))
        i += n
    pieces.append(stream.flush())
    assert (torch.cat(pieces) - expected).abs().max().item() < 1e-12


# --- GPU --------------------------------------------------------------------------------------

def test_batch_buckets_pad_past_32_rows_by_at_most_a_third_and_are_all_warmed():
    """A batch of n streams runs the step graph of bucket_rows(n) rows: powers of two up to 32,
    then 48, 64, 96, 128, 192, ... (a step's GPU time is about linear there: padding 65 streams to
    128 rows took half the call). Every batch a warm-up's max_batch admits has its graph warmed."""
    assert [bucket_rows(n) for n in (1, 3, 17, 33, 48, 49, 65, 97, 129, 193, 257, 385)] == \
        [1, 4, 32, 48, 48, 64, 96, 128, 192, 256, 384, 512]
    assert all(n <= bucket_rows(n) and (n <= 32 or 3 * n > 2 * bucket_rows(n)) for n in range(1, 2049))
    for top in range(1, 600):
        assert {bucket_rows(n) for n in range(1, top + 1)} <= set(warmup_buckets(top)), top
    engine = FastSNAC(synthetic_model("snac_24khz"), device="cpu").stream_engine(512)
    rows = sorted({b for _, b, _ in engine.steps.warmup_shapes(512, ())})
    assert rows == [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512]


@pytest.mark.gpu
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_streams_equal_decode(cuda, no_tf32, name, dtype):
    """CUDA graphs per (kind, batch bucket, frames); three streams of different lengths, batched."""
    fast = FastSNAC.from_pretrained(f"synthetic:{name}", device=cuda, dtype=dtype)
    engine = fast.stream_engine(8)
    assert engine.cuda_graphs
    g, strides = engine.frames_per_group, fast.config["vq_strides"]
    lengths = [engine.prefill_frames + g * k for k in (1, 5, 9)]
    codes = [random_codes(fast.config, n, seed=n) for n in lengths]
    slots = [engine.open(seed=7 + i) for i in range(3)]
    got = [[] for _ in lengths]
    position = [0, 0, 0]
    rng = random.Random(0)
    while any(p < n for p, n in zip(position, lengths)):
        pushes = {}
        for i, slot in enumerate(slots):
            if position[i] < lengths[i]:
                k = min(lengths[i] - position[i], g * rng.randint(1, 3))
                pushes[slot] = frames_of(codes[i], strides, position[i], position[i] + k)
                position[i] += k
        for slot, audio in engine.advance(pushes).items():
            got[slots.index(slot)].append(audio)
    for slot, audio in engine.advance(finish=slots).items():
        got[slots.index(slot)].append(audio)
    for i in range(3):
        expected = fast.decode(codes[i], seed=7 + i)[0, 0].float()
        snr = snr_db(expected, torch.cat(got[i]).float())
        print(f"{name} {dtype} stream {i}: {snr:.1f} dB vs decode")
        assert snr >= (100 if dtype == torch.float32 else 50)
    assert len(engine.steps.graphs) >= 3


@pytest.mark.gpu
def test_gpu_batches_between_powers_of_two_run_their_bucket_graphs_exactly(cuda, no_tf32):
    """Batches of 40 and 70 streams run the 48- and 96-row step graphs (and prefill and flush
    graphs of those buckets, padded with the scratch slot); every stream equals its whole decode
    in float32."""
    fast = FastSNAC.from_pretrained("synthetic:snac_24khz", device=cuda, dtype=torch.float32)
    engine = fast.stream_engine(96)
    strides, n = fast.config["vq_strides"], engine.prefill_frames + 3 * engine.frames_per_group
    for streams, bucket in ((40, 48), (70, 96)):
        codes = [random_codes(fast.config, n, seed=100 + i) for i in range(streams)]
        got = prefill_step_and_finish(engine, codes, strides)
        assert {key[1] for key in engine.steps.graphs} >= {bucket}
        for i in (0, streams // 2, streams - 1):
            expected = fast.decode(codes[i], seed=i)[0, 0]
            assert snr_db(expected, got[i]) >= 100, (streams, i)


def prefill_step_and_finish(engine, codes, strides):
    """Stream i (seed i) of each of ``codes`` (per level [1, L_i]) through ``engine``: its prefill's
    frames in one call for all, the rest in a second, then the finish; returns each stream's audio."""
    n = codes[0][0].shape[1]  # level 0: one id a coarse frame
    slots = [engine.open(seed=i) for i in range(len(codes))]
    got = {slot: [] for slot in slots}
    for start, stop in ((0, engine.prefill_frames), (engine.prefill_frames, n)):
        for slot, audio in engine.advance({s: frames_of(c, strides, start, stop) for s, c in zip(slots, codes)}).items():
            got[slot].append(audio)
    for slot, audio in engine.advance(finish=slots).items():
        got[slot].append(audio)
    return [torch.cat(got[slot]) for slot in slots]


@pytest.mark.gpu
def test_gpu_steps_in_slices_of_rows_under_cuda_graphs_equal_decode(cuda, no_tf32):
    """rows_per_pass=24 on a 64-row engine: every captured step runs its stages on slices of 24, 24
    and 16 rows, each taking its rows of the graph's noise; every stream equals its whole decode in
    float32, as the whole steps do."""
    fast = FastSNAC.from_pretrained("synthetic:snac_24khz", device=cuda, dtype=torch.float32)
    engine = fast.stream_engine(64, rows_per_pass=24)
    engine.warmup(max_batch=64)
    strides, n = fast.config["vq_strides"], engine.prefill_frames + 3 * engine.frames_per_group
    codes = [random_codes(fast.config, n, seed=200 + i) for i in range(64)]
    got = prefill_step_and_finish(engine, codes, strides)
    assert ("step", 64, engine.frames_per_group) in engine.steps.graphs
    for i in (0, 23, 24, 47, 48, 63):  # each slice's first and last rows
        expected = fast.decode(codes[i], seed=i)[0, 0]
        assert snr_db(expected, got[i]) >= 100, i


def steady_steps_with_bad_ids(engine, config, seed=20):
    """Three started streams stepped one frame at a time, alternately through step (int32 codes)
    and advance (per-stream pushes); before every good step, bad ids (too large, negative) in both
    must raise naming their level and leave every stream as it was. Returns the codes and each
    stream's audio (stream b: row b under ``seed``)."""
    strides, size = config["vq_strides"], config["codebook_size"]
    frames = engine.prefill_frames + 12
    codes = random_codes(config, frames, batch=3, seed=5)
    streams = [engine.open(seed=seed, row=b) for b in range(3)]
    pieces = [list(engine.step(streams, frames_of_rows(codes, strides, 0, engine.prefill_frames)))]
    for f in range(engine.prefill_frames, frames):
        step = frames_of_rows(codes, strides, f, f + 1)
        consumed = engine.slots.consumed.copy()
        for level, value in ((2, size), (0, -1)):
            bad = [c.clone() for c in step]
            bad[level][1, 0] = value
            with pytest.raises(ValueError, match=f"level {level} holds id {value}"):
                engine.step(streams, bad)
            with pytest.raises(ValueError, match=f"level {level} holds id {value}"):
                engine.advance({s: [c[b] for c in bad] for b, s in enumerate(streams)})
        assert (engine.slots.consumed == consumed).all() and engine.pending.frames_held == 0
        if f % 2:
            pieces.append(engine.step(streams, [c.to(torch.int32) for c in step]))
        else:
            out = engine.advance({s: [c[b:b + 1] for c in step] for b, s in enumerate(streams)})
            pieces.append([out[s] for s in streams])
    ends = engine.advance(finish=streams)
    return codes, [torch.cat([p[b] for p in pieces] + [ends[s]]) for b, s in enumerate(streams)]


def test_steady_steps_check_ids_before_any_state_changes():
    config = published_config("snac_24khz")
    codes, audio = steady_steps_with_bad_ids(engine64("snac_24khz", streams=8), config)
    expected = decode_with_keyed_noise(upstream64("snac_24khz"), codes, 20)
    for b, got in enumerate(audio):
        assert (got - expected[b, 0]).abs().max().item() < 1e-12


@pytest.mark.gpu
@pytest.mark.parametrize("name, lookahead", [("snac_24khz", 2048), ("snac_32khz", 6144)])
def test_gpu_approximate_streams_under_cuda_graphs(cuda, name, lookahead):
    """Approximate streams on CUDA in float32 (graphs: the step, then the flush of saved and
    restored state rows), three at once in one engine, against the float64 construction from whole
    decodes on the CPU."""
    fast = FastSNAC.from_pretrained(f"synthetic:{name}", device=cuda, dtype=torch.float32)
    engine = fast.stream_engine(8, lookahead=lookahead)
    engine.warmup(max_batch=4)
    g, strides = engine.frames_per_group, fast.config["vq_strides"]
    splits = [g] * 6
    codes = [random_codes(fast.config, sum(splits), seed=20 + i) for i in range(3)]
    slots = [engine.open(seed) for seed in range(3)]
    got = {s: [] for s in slots}
    f = 0
    for k in splits:
        out = engine.advance({s: frames_of(c, strides, f, f + k) for s, c in zip(slots, codes)})
        for s in slots:
            got[s].append(out[s].cpu())
        f += k
    for s, piece in engine.advance(finish=slots).items():
        got[s].append(piece.cpu())
    for seed, (s, c) in enumerate(zip(slots, codes)):
        want = torch.cat(approximate_reference(name, c, strides, splits, lookahead, engine.samples_per_frame,
                                               seed=seed, narrow=False)).float()
        assert snr_db(want, torch.cat(got[s]).float()) >= 100


@pytest.mark.gpu
def test_gpu_steady_steps_check_ids_before_any_state_changes(cuda, no_tf32):
    """On CUDA the steady state writes codes and keys straight into a graph's pinned inputs and
    checks the ids there; 3 streams run in the graph of 4 rows."""
    fast = FastSNAC.from_pretrained("synthetic:snac_24khz", device=cuda, dtype=torch.float32)
    engine = fast.stream_engine(8)
    codes, audio = steady_steps_with_bad_ids(engine, fast.config)
    assert ("step", 4, 1) in engine.steps.graphs
    expected = fast.decode(codes, seed=20)
    for b, got in enumerate(audio):
        assert snr_db(expected[b, 0], got) >= 100


@pytest.mark.gpu
def test_gpu_warmed_engine_captures_no_graph_while_serving(cuda, no_tf32):
    """After warmup(), pushes of 1, 2 and 3 frames and a new batch size capture nothing: the audio
    still equals the decode."""
    fast = FastSNAC.from_pretrained("synthetic:snac_24khz", device=cuda, dtype=torch.float32)
    engine = fast.stream_engine(8)
    engine.warmup()
    serve_three_streams_capturing_nothing(fast, engine, [engine.prefill_frames, 1, 2, 3, 1, 2, 3], seed=4, codes_seed=13)


def serve_three_streams_capturing_nothing(fast, engine, pushes: list[int], seed: int, codes_seed: int) -> None:
    """Three streams of a warmed engine pushed ``pushes`` frames at a time, then finished: no new
    graph is captured and each stream's audio equals the decode's row (float32, >= 100 dB)."""
    strides, graphs = fast.config["vq_strides"], set(engine.steps.graphs)
    codes = random_codes(fast.config, sum(pushes), batch=3, seed=codes_seed)
    streams = [engine.open(seed=seed, row=b) for b in range(3)]
    pieces, f = [], 0
    for k in pushes:
        pieces.append(engine.step(streams, frames_of_rows(codes, strides, f, f + k)))
        f += k
    ends = engine.advance(finish=streams)
    assert set(engine.steps.graphs) == graphs
    expected = fast.decode(codes, seed=seed)
    for b, s in enumerate(streams):
        assert snr_db(expected[b, 0], torch.cat([p[b] for p in pieces] + [ends[s]])) >= 100


@pytest.mark.gpu
def test_gpu_codec_warmup_compiles_in_one_pass_then_captures_every_step(cuda, no_tf32, monkeypatch):
    """codec.warmup(streams=N): the kernels of the engine's steps compile in the same concurrent pass
    (the same pool) as the decode shapes' (in two passes, the first one's last compiles left most
    cores idle), then every step graph up to N streams is captured, so serving 3 streams captures
    nothing more and still equals the decode."""
    import snac_fast.runtime.compiling as compiling
    from snac_fast.streaming import StreamEngine

    pools, seen = [], []
    unpatched_pool, unpatched_compile = compiling._CompileAndBuildLauncher.__init__, StreamEngine.compile_steps
    monkeypatch.setattr(compiling._CompileAndBuildLauncher, "__init__",
                        lambda self, *args, **kwargs: pools.append(self) or unpatched_pool(self, *args, **kwargs))
    monkeypatch.setattr(StreamEngine, "compile_steps", lambda self, *args, **kwargs: seen.append(
        (len(pools), getattr(compiling._this_thread, "compile_only", False))) or unpatched_compile(self, *args, **kwargs))
    # no manifest shortcut: a Triton cache that an earlier run filled (a warm machine) skips the pass
    monkeypatch.setattr("snac_fast.runtime.warmup._manifest_path", lambda *args: None)
    fast = FastSNAC.from_pretrained("synthetic:snac_24khz", device=cuda, dtype=torch.float32)
    before = len(pools)
    times = fast.warmup([1], [4], streams=4)
    assert seen == [(before + 1, True)] and set(times) == {"compile_s", "decode_s", "stream_s"}
    engine = fast.shared_stream_engine()
    assert {(kind, rows) for kind, rows, _ in engine.steps.graphs} == {(kind, rows) for kind in ("prefill", "step", "flush")
                                                                  for rows in (1, 2, 4)}
    serve_three_streams_capturing_nothing(fast, engine, [engine.prefill_frames, 1, 1, 1, 1], seed=5, codes_seed=17)


@pytest.mark.gpu
def test_gpu_codec_warmup_pass_compiles_every_variant_its_captures_launch(cuda, tmp_path):
    """After warmup's compile pass, the decode and step captures launch no kernel variant that the
    pass did not compile: a miss is compiled (or loaded) one by one then, on a server's cold start.
    Run in a fresh process (this one's kernels are already loaded, which would hide a miss) with an
    empty Triton cache (a filled one's manifest skips the pass, and the captures then load every
    kernel: on a warm machine this failed with nothing missed); any Triton compile after the pass
    reaches the post-compile hook, whose calls are counted."""
    script = (
        "import torch, triton\n"
        "import snac_fast.runtime.warmup as warmup\n"
        "from snac_fast import FastSNAC\n"
        f"fast = FastSNAC.from_pretrained('synthetic:snac_24khz', device='{cuda}')\n"
        "late, compile_kernels = [], warmup.compile_kernels\n"
        "def hook(*, fn, compile, **kw):\n"
        "    late.append((fn.name, compile['constants']))\n"
        "def counted(*a, **k):\n"
        "    try:\n"
        "        return compile_kernels(*a, **k)\n"
        "    finally:\n"
        "        triton.knobs.runtime.jit_post_compile_hook = hook\n"
        "warmup.compile_kernels = counted\n"
        "fast.warmup([1, 3], [4], streams=8)\n"
        "print('late', late)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "late []"


@pytest.mark.gpu
def test_gpu_back_to_back_steps_wait_for_their_uploads(cuda, no_tf32):
    """Steps queued behind a busy GPU: a call rewrites the step graph's pinned inputs only once the
    replay before it has uploaded them (the event that graph records), so each step decodes its own
    codes even when the host runs far ahead."""
    fast = FastSNAC.from_pretrained("synthetic:snac_24khz", device=cuda, dtype=torch.float32)
    engine, strides = fast.stream_engine(4), fast.config["vq_strides"]
    frames = engine.prefill_frames + 24
    codes = random_codes(fast.config, frames, batch=2, seed=9)
    streams = [engine.open(seed=3, row=b) for b in range(2)]
    start = engine.prefill_frames + 1
    pieces = [engine.step(streams, frames_of_rows(codes, strides, 0, engine.prefill_frames)),
              engine.step(streams, frames_of_rows(codes, strides, engine.prefill_frames, start))]  # captures
    torch.cuda.synchronize(cuda)
    torch.cuda._sleep(100_000_000)  # the GPU spins ~50 ms ahead of every replay below
    for f in range(start, frames):
        pieces.append(engine.step(streams, frames_of_rows(codes, strides, f, f + 1)))
    ends = engine.advance(finish=streams)
    expected = fast.decode(codes, seed=3)
    for b, s in enumerate(streams):
        assert snr_db(expected[b, 0], torch.cat([p[b] for p in pieces] + [ends[s]])) >= 100


def test_steps_in_slices_of_rows_equal_the_whole_decode():
    """rows_per_pass: each step's stages run on slices of at most that many rows (5 streams: 2, 2
    and 1), each slice's noise drawn from its own keys; every stream still equals its row of the
    whole decode to float64 rounding, and the slices are what ran. Narrow (helpers.NARROW): what
    is checked is the slicing."""
    name, rows_per_pass = "snac_24khz", 2
    config = {**published_config(name), **NARROW}
    engine = engine64(name, streams=5, narrow=True, layered=False, max_frames_per_step=2, rows_per_pass=rows_per_pass)
    passes = []
    forward_rows = engine.forward._forward_rows
    engine.forward._forward_rows = lambda kind, keys, *rest: passes.append(keys.shape[1]) or forward_rows(kind, keys, *rest)
    g, strides = engine.frames_per_group, config["vq_strides"]
    frames = engine.prefill_frames + 3 * g
    codes = random_codes(config, frames, batch=5, seed=8)
    expected = decode_with_keyed_noise(upstream64(name, True), codes, 13)
    streams = [engine.open(13, row=b) for b in range(5)]
    pieces, f = [[] for _ in streams], 0
    for k in [engine.prefill_frames, g, 2 * g]:
        for piece, audio in zip(pieces, engine.step(streams, frames_of_rows(codes, strides, f, f + k))):
            piece.append(audio)
        f += k
    ends = engine.advance(finish=streams)
    assert passes and set(passes) == {1, 2} and sum(passes) % 5 == 0
    for b, s in enumerate(streams):
        got = torch.cat(pieces[b] + [ends[s]])
        assert got.shape == expected[b, 0].shape
        assert (got - expected[b, 0]).abs().max().item() < 1e-12, b


def test_rows_per_pass_is_checked_and_a_change_drops_the_captured_graphs():
    engine = engine64("snac_24khz", streams=2, layered=False)
    assert engine.rows_per_pass == ROWS_PER_PASS
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="rows_per_pass must be None or an int >= 1"):
            engine.rows_per_pass = bad
    engine.steps.graphs[("step", 2, 1)] = object()
    engine.steps.warmed = {("step", 2, 1)}
    engine.rows_per_pass = ROWS_PER_PASS  # unchanged: the graphs stay
    assert engine.steps.graphs
    engine.rows_per_pass = None
    assert engine.rows_per_pass is None and not engine.steps.graphs and engine.steps.warmed is None
