"""snac_fast.encoding: the fused encoder end to end against upstream, the receptive field, chunked
long-audio encodes equal to whole ones, CUDA graphs (its kernels: tests/ops/test_dense_conv.py,
tests/ops/test_codebook.py)."""

import pytest
import torch
from helpers import NARROW

from snac_fast import FastSNAC
from snac_fast.encoding import Chunk, encoder_reach, padding_unit, plan_chunks
from snac_fast.model.modules import DepthwiseConv1d, FusedDenseConv1d, FusedResidualUnit
from snac_fast.model.synthetic import speech_like, synthetic_model

MODELS = ["snac_24khz", "snac_32khz", "snac_44khz"]
# the published structure in miniature (hop 6): receptive fields of ~150 samples, so that chunked
# encodes of a few thousand samples cross several chunk boundaries
# (and 256 codewords: the interpreter pays per codebook tile)
TINY = {"encoder_dim": 16, "encoder_rates": [2, 3], "decoder_dim": 32, "decoder_rates": [3, 2], "codebook_size": 256}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # of the largest |output|


def tiny_model(name: str, dtype=torch.float32) -> FastSNAC:
    extra = {"attn_window_size": 4} if name != "snac_24khz" else {}
    return FastSNAC(synthetic_model(name, **TINY, **extra), device="cpu", dtype=dtype)




@pytest.mark.heavy
@pytest.mark.parametrize("name", MODELS)
def test_fused_encoder_matches_float64_upstream(name):
    """Every encoder layer fused (dense convs, residual units, output conv, quantizer); the latent
    against upstream in float64 and the codes against upstream's, batch 2, a length to pad."""
    fast = FastSNAC(synthetic_model(name, **NARROW), device="cpu", dtype=torch.float32)
    fused = fast.report.fused
    assert len(fused["encoder_dense_convs"]) == 5 and len(fused["encoder_residual_units"]) == 12
    assert fused["encoder_output_conv"] == [f"encoder.block.{len(fast.model.encoder.block) - 1}"]
    assert fused["encoder_quantizer"] == ["quantizer"]
    encoder = fast.model.encoder.block
    assert isinstance(encoder[0], FusedDenseConv1d) and isinstance(encoder[-1], DepthwiseConv1d)
    for block in list(encoder)[1:5]:
        units, conv = block.block[:3], block.block[4]
        assert all(isinstance(u, FusedResidualUnit) for u in units) and isinstance(conv, FusedDenseConv1d)
        assert units[2].channels_last_out and units[2].alpha_out is block.block[3].alpha
    reference = synthetic_model(name, **NARROW).double()
    audio = torch.randn(2, 1, 3001, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.2
    with torch.inference_mode():
        latent = fast.model.encoder(fast.model.preprocess(audio.float()))
        expected_latent = reference.encoder(reference.preprocess(audio))
        codes, expected = fast.encode(audio.float()), reference.encode(audio)
    torch.testing.assert_close(latent.double(), expected_latent, rtol=0, atol=1e-5 * expected_latent.abs().max().item())
    assert [c.shape for c in codes] == [c.shape for c in expected]
    agree = sum((a == b).sum().item() for a, b in zip(codes, expected)) / sum(c.numel() for c in codes)
    assert agree >= 0.99  # float32 against float64: only a near-tie may flip


@pytest.mark.parametrize("name", ["snac_24khz", "snac_32khz"])
def test_receptive_field_bounds_what_a_span_reads(name):
    """Audio outside [start - reach, end + reach) of a span aligned to the padding unit leaves the
    span's latent unchanged (float64); audio well inside the reach changes it."""
    extra = {"attn_window_size": 4} if name != "snac_24khz" else {}
    model = synthetic_model(name, **TINY, **extra).double()
    config = {"encoder_rates": TINY["encoder_rates"], "vq_strides": model.vq_strides,
              "attn_window_size": model.attn_window_size}
    reach, unit, hop = encoder_reach(model), padding_unit(config), model.hop_length
    start, end, length = 8 * unit, 12 * unit, 24 * unit
    gen = torch.Generator().manual_seed(3)
    audio = torch.randn(1, 1, length, generator=gen, dtype=torch.float64)
    outside = audio.clone()
    outside[..., :start - reach] = torch.randn(start - reach, generator=gen, dtype=torch.float64)
    outside[..., end + reach:] = torch.randn(length - end - reach, generator=gen, dtype=torch.float64)
    inside = audio.clone()
    inside[..., start - reach // 2] += 1.0
    with torch.no_grad():
        span = [model.encoder(a)[..., start // hop:end // hop] for a in (audio, outside, inside)]
    assert torch.equal(span[0], span[1])
    assert not torch.equal(span[0], span[2])


def test_plan_chunks_cover_the_input_once():
    unit = 48
    assert plan_chunks(10 * unit, 2 * unit, 4 * unit, unit) == [Chunk(0, 480, 0, 480)]  # fits with its halos
    chunks = plan_chunks(100 * unit, 30 * unit, 50, unit)  # halo rounds up to 2 units, chunks stay 30
    assert [(c.keep_start, c.keep_end) for c in chunks] == [(0, 1440), (1440, 2880), (2880, 4320), (4320, 4800)]
    assert [(c.read_start, c.read_end) for c in chunks] == [(0, 1536), (1344, 2976), (2784, 4416), (4224, 4800)]
    with pytest.raises(ValueError, match="multiple of the padding unit"):
        plan_chunks(100, 48, 0, unit)


@pytest.mark.parametrize("name", ["snac_24khz", "snac_32khz"])
def test_chunked_encode_equals_whole(name):
    """Several chunks with halos (an odd length, batch 3): the same codes as one whole encode."""
    fast = tiny_model(name)
    audio = torch.from_numpy(speech_like(1201 / fast.sampling_rate, fast.sampling_rate, 4)).repeat(3, 1, 1)
    audio[1] *= 0.5
    audio[2] = audio[2].flip(-1)
    whole = fast.encode(audio, chunk_seconds=None)
    unit = padding_unit(fast.config)
    chunk = (8 if name == "snac_24khz" else 4) * unit
    chunks = plan_chunks(-(-1201 // unit) * unit, chunk, encoder_reach(fast.model), unit)
    assert len(chunks) >= 3
    chunked = fast.encode(audio, chunk_seconds=chunk / fast.sampling_rate)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


@pytest.mark.heavy
@pytest.mark.parametrize("name, fuse", [("snac_24khz", True), ("snac_24khz", False), ("snac_32khz", False)])
def test_padded_batch_rows_equal_each_clip_alone(name, fuse):
    """Clips of odd, different lengths in one zero-padded batch (noise past each row's end, which
    must be ignored), encoded with ``lengths``: each row's codes are the clip's own encode's exactly
    (float32), whole and chunked; without ``lengths`` the short rows' codes differ (the test can fail)."""
    extra = {"attn_window_size": 4} if name != "snac_24khz" else {}
    fast = FastSNAC(synthetic_model(name, **TINY, **extra), device="cpu", dtype=torch.float32,
                    fuse=fuse, accelerate_encoder=fuse)
    lengths = [1201, 377, 96, 1999]  # the last fills the batch (padded to the unit)
    gen = torch.Generator().manual_seed(9)
    batch = torch.randn(len(lengths), 1, max(lengths), generator=gen) * 0.3
    clips = [batch[i:i + 1, :, :n].clone() for i, n in enumerate(lengths)]
    alone = [fast.encode(clip) for clip in clips]
    zeroed = batch * (torch.arange(batch.shape[-1]) < torch.tensor(lengths)[:, None])[:, None]
    without = fast.encode(zeroed)
    unit = padding_unit(fast.config)
    chunk = (8 if name == "snac_24khz" else 4) * unit
    for rows in (fast.encode(batch, lengths=lengths), fast.encode(batch, lengths=torch.tensor(lengths),
                                                                   chunk_seconds=chunk / fast.sampling_rate)):
        for i, own in enumerate(alone):
            for level, (want, got) in enumerate(zip(own, rows)):
                assert torch.equal(got[i, :want.shape[1]], want[0]), (lengths[i], level)
    differ = [any(not torch.equal(got[i, :want.shape[1]], want[0]) for want, got in zip(own, without))
              for i, own in enumerate(alone)]
    assert differ[1] and differ[2]  # short rows: the padding's layers reach their codes


def test_rows_that_fill_the_batch_encode_as_plain_and_no_hook_stays():
    """Rows whose padded lengths fill the batch give the plain encode's codes, and no hook stays on
    the model after an encode with lengths."""
    fast = tiny_model("snac_24khz")
    audio = torch.randn(2, 1, 480, generator=torch.Generator().manual_seed(4)) * 0.3
    plain = fast.encode(audio)
    assert all(torch.equal(a, b) for a, b in zip(plain, fast.encode(audio, lengths=[480, 479])))
    fast.encode(audio, lengths=[480, 100])
    assert not any(m._forward_hooks for m in fast.model.modules())
    assert all(torch.equal(a, b) for a, b in zip(plain, fast.encode(audio)))


@pytest.mark.parametrize("lengths, message", [
    ([100], "1 entries for 2 rows"), ([100, 0], r"in \[1, 480\]"), ([100, 481], "got 481"),
    ([100, 2.5], "whole numbers"), (torch.tensor([1.0, 2.0]), "integer tensor"), ("ab", "whole numbers")])
def test_encode_rejects_bad_lengths(lengths, message):
    with pytest.raises(ValueError, match=message):
        tiny_model("snac_24khz").encode(torch.zeros(2, 1, 480), lengths=lengths)


def test_encode_rejects_bad_chunk_seconds():
    fast = tiny_model("snac_24khz")
    with pytest.raises(ValueError, match="chunk_seconds"):
        fast.encode(torch.zeros(1, 1, 100), chunk_seconds=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["snac_24khz", "snac_32khz"])
def test_gpu_fused_encode_graphs_chunks_and_upstream(cuda, name):
    """Full widths, fp16 on CUDA: graph replays give the eager codes, a chunked encode agrees with the
    whole one, and the codes agree with upstream fp32 on >= 99% of speech-like positions per level."""
    fast = FastSNAC(synthetic_model(name), device=cuda, dtype=torch.float16)
    upstream = synthetic_model(name).to(cuda)
    rate = fast.sampling_rate
    audio = torch.from_numpy(speech_like(7.3, rate, 5)).view(1, 1, -1).repeat(2, 1, 1).to(cuda)
    audio[1] *= 0.7
    eager_limit, fast.encode_graph_samples = fast.encode_graph_samples, 0
    eager = fast.encode(audio)
    fast.encode_graph_samples = eager_limit
    graphed = [fast.encode(audio) for _ in range(2)]
    assert len(fast.encode_graphs) == 1
    assert all(torch.equal(a, b) for g in graphed for a, b in zip(eager, g))
    chunked = fast.encode(audio, chunk_seconds=2.0)
    with torch.inference_mode():
        expected = upstream.encode(audio)
    for ours, split, theirs in zip(eager, chunked, expected):
        assert ours.shape == theirs.shape and ours.dtype == torch.int64
        assert (ours == split).float().mean().item() >= 0.995
        assert (ours == theirs).float().mean().item() >= 0.99


@pytest.mark.gpu
def test_gpu_padded_batch_rows_agree_with_each_clip_alone(cuda):
    """Full widths, fp16: clips of different lengths in one padded batch with ``lengths``, eager and
    from CUDA graphs (one graph, two sets of lengths), agree with each clip's own fp16 encode as
    closely as fp16 encodes of one clip at two batch shapes agree, and better than without lengths."""
    fast = FastSNAC(synthetic_model("snac_24khz"), device=cuda, dtype=torch.float16)
    rate = fast.sampling_rate
    seconds = [2.1, 0.37, 3.3, 1.05]
    clips = [torch.from_numpy(speech_like(s, rate, 20 + i)).view(1, 1, -1).to(cuda) for i, s in enumerate(seconds)]
    lengths = [c.shape[-1] for c in clips]
    batch = torch.zeros(len(clips), 1, max(lengths), device=cuda)
    for i, c in enumerate(clips):
        batch[i, :, :lengths[i]] = c
    alone = [fast.encode(c, cuda_graphs=False) for c in clips]

    def agreement(codes, rows=range(len(clips))):
        same = total = 0
        for i in rows:
            for want, got in zip(alone[i], codes):
                n = want.shape[1]
                same += (got[i, :n] == want[0]).sum().item()
                total += n
        return same / total

    # fp16 against fp16: one clip encoded alone and as every row of a batch of its own length
    twin = fast.encode(clips[0].repeat(3, 1, 1), cuda_graphs=False)
    floor = min(agreement(twin, [0]), 0.995)
    eager = fast.encode(batch, lengths=lengths, cuda_graphs=False)
    graphed = fast.encode(batch, lengths=lengths, cuda_graphs=True)
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed))
    assert agreement(eager) >= floor
    assert agreement(eager) > agreement(fast.encode(batch, cuda_graphs=False))
    # the same graph with other lengths: the static lengths are refreshed on each replay
    shorter = [n // 2 for n in lengths]
    replayed = fast.encode(batch, lengths=shorter, cuda_graphs=True)
    assert len(fast.encode_graphs) == 1
    assert all(torch.equal(a, b) for a, b in zip(replayed, fast.encode(batch, lengths=shorter, cuda_graphs=False)))


@pytest.mark.gpu
def test_gpu_corpus_graphs_capture_on_second_call_and_share_one_pool(cuda):
    """GraphedEncode(capture_at=2, shared_pool=True), the corpus engine's: a shape's first call runs
    eagerly, its second is captured and replayed (the same codes); every graph allocates from one
    pool, so graphs of smaller shapes after the largest add almost no memory."""
    from snac_fast.encoding import GraphedEncode

    fast = FastSNAC(synthetic_model("snac_24khz"), device=cuda, dtype=torch.float16)
    graphs = GraphedEncode(fast.model, fast.device, max_graphs=8, capture_at=2, shared_pool=True)
    unit = padding_unit(fast.config)
    reserved = []
    for k, (rows, units) in enumerate([(8, 96), (6, 64), (4, 80), (8, 40)]):  # the largest first
        audio = (torch.randn(rows, 1, units * unit, device=cuda) * 0.1).half()
        with torch.inference_mode():
            eager = graphs(audio)
            assert graphs.captures == k  # first call: eager
            replayed = graphs(audio)
        assert graphs.captures == k + 1 and all(torch.equal(a, b) for a, b in zip(eager, replayed))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the eager calls' cached blocks; the graphs' pool stays
        reserved.append(torch.cuda.memory_reserved(cuda))
    assert reserved[-1] - reserved[0] < 0.25 * reserved[0], reserved
