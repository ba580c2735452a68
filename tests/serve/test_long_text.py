"""A long speech input: segments at sentence ends, one LM request each, all pushed into the request's
one stream. The audio equals the offline decode of every segment's whole frames, concatenated
(float32 >= 100 dB): the joins are the decoder's own, with no seam."""

import asyncio
import time

import httpx
import numpy as np
import torch
from helpers import NARROW, random_codes
from live_server import serving

from snac_fast import FastSNAC
from snac_fast.metrics import snr_db
from snac_fast.model.synthetic import synthetic_model
from snac_fast.serve.lm.client import LMOutputError
from snac_fast.serve.lm.segments import split_text

TEXT = ("The first sentence is here. A second one follows it closely! Does a third ask a question? "
        "And the fourth ends the text.")


def test_a_long_input_is_one_exact_stream_over_its_segments():
    codec = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu", fuse=False)
    segments = split_text(TEXT, 40)
    assert len(segments) == 4
    codes = [random_codes(codec.config, n, seed=900 + k) for k, n in enumerate((5, 3, 4, 6))]
    with serving(codec, segment_chars=40, max_input_chars=200) as (server, lm, _):
        lm.script(segments[0], codes[0], delay=0.03)  # slow: the next request goes out before it ends
        lm.script(segments[1], codes[1], stop_early=True)  # cut mid-frame: its last piece of a frame is dropped
        lm.script(segments[2], codes[2])
        lm.script(segments[3], codes[3])
        started = time.monotonic()
        r = httpx.post(server.url + "/v1/audio/speech", timeout=120,
                       json={"input": TEXT, "response_format": "pcm", "sample_format": "f32", "seed": 7})
        too_long = httpx.post(server.url + "/v1/audio/speech", json={"input": "x" * 201})
    assert r.status_code == 200, r.text
    assert [p.split(": ", 1)[1].split("<|eot_id|>")[0] for p in lm.prompts] == segments  # in order, each once
    assert lm.received[segments[1]] < lm.finished[segments[0]]  # pipelined: asked while the first still spoke
    assert all(started < lm.received[s] for s in segments)
    frames = [5, 2, 4, 6]  # whole frames of each answer
    joined = [torch.cat([c[level][:, :n * c[level].shape[1] // len0] for c, n, len0 in
                         zip(codes, frames, (5, 3, 4, 6))], dim=1) for level in range(len(codes[0]))]
    want = codec.decode(joined, seed=7)[0, 0].double()
    got = torch.from_numpy(np.frombuffer(r.content, "<f4").astype(np.float64))
    assert got.shape == want.shape and snr_db(want, got) >= 100
    assert too_long.status_code == 400 and "at most 200" in too_long.json()["error"]["message"]


class _ChunkedLM:
    """An LM stand-in answering each text with its list of id chunks, then, if given, an error."""

    def __init__(self, answers: dict, error: Exception | None = None) -> None:
        self.answers, self.error = answers, error

    async def ids(self, text, voice, model):
        for chunk in self.answers[text]:
            await asyncio.sleep(0)
            yield chunk
        if self.error is not None:
            raise self.error


def _pieces(lm, texts: list[str], slow_s: float) -> list[tuple[int, list[int]]]:
    """What segment_ids yields, read by a consumer that takes ``slow_s`` over each piece (an engine round)."""
    from snac_fast.serve.services.speech import segment_ids

    async def run():
        out = []

        async def listed():
            for text in texts:
                yield text
        try:
            async for k, ids in segment_ids(lm, listed(), "tara", None):
                out.append((k, ids))
                await asyncio.sleep(slow_s)
        except LMOutputError as e:
            out.append((-1, [str(e)]))
        return out
    return asyncio.run(run())


def test_a_segment_behind_its_lm_catches_up_in_one_piece():
    """The ids the LM sent while the segment before still spoke come as one piece (one engine push),
    not one piece per LM chunk: one push a round held text WebSockets' audio seconds behind the LM."""
    rng = np.random.default_rng(5)
    chunks = {text: [rng.integers(0, 4096, rng.integers(1, 5)).tolist() for _ in range(40)] for text in ("a", "b")}
    pieces = _pieces(_ChunkedLM(chunks), ["a", "b"], slow_s=0.05)
    assert [i for k, ids in pieces if k == 0 for i in ids] == [i for c in chunks["a"] for i in c]
    later = [ids for k, ids in pieces if k == 1]
    assert later == [[i for c in chunks["b"] for i in c]]  # all 40 chunks were queued by then


def test_ids_before_an_lm_error_come_out_before_it():
    chunks = {"a": [[1, 2, 3], [4, 5, 6, 7], [8]]}
    pieces = _pieces(_ChunkedLM(chunks, LMOutputError("cut")), ["a"], slow_s=0.05)
    assert [i for k, ids in pieces if k == 0 for i in ids] == list(range(1, 9))
    assert pieces[-1] == (-1, ["cut"])
