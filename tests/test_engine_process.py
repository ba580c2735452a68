"""snac_fast.engine_process: one engine process (spawned, CPU here) fed by front-ends over a Unix
socket. Every stream's audio equals the offline decode of its codes; errors stay with their stream;
a cancelled await and a front-end that disconnects release their streams."""

import asyncio
import time

import numpy as np
import pytest
import torch

from helpers import NARROW, random_codes
from snac_fast import FastSNAC
from snac_fast.engine_process import EngineClient, EngineProcess
from snac_fast.metrics import snr_db
from snac_fast.orpheus import ORPHEUS
from snac_fast.synthetic import make_checkpoint

OPTIONS = {"fuse": False, "accelerate_encoder": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("engine") / "model", "snac_24khz", **NARROW))


@pytest.fixture(scope="module")
def engine(checkpoint):
    with EngineProcess(checkpoint, device="cpu", max_streams=8, max_batch=4, output="float32",
                       model_options=OPTIONS) as process:
        yield process


async def speak(client, codes, seed, per_push=7):
    """One stream: its ids pushed in pieces of ``per_push`` (frames cut anywhere), then flushed."""
    ids = ORPHEUS.codes_to_ids(codes).numpy().ravel()
    sid = await client.open(seed)
    pieces = [await client.push_ids(sid, ids[k:k + per_push]) for k in range(0, ids.size, per_push)]
    pieces.append(await client.flush(sid))
    return np.concatenate(pieces)


def test_two_front_ends_get_exact_audio(engine, checkpoint):
    codec = FastSNAC.from_pretrained(checkpoint, device="cpu", dtype=torch.float32, **OPTIONS)
    codes = [random_codes(codec.config, 8, seed=100 + k) for k in range(5)]

    async def front_end(streams):
        client = EngineClient(engine.address)
        try:  # the streams of one front-end at once, pushes cut at 7 and 5 ids
            return await asyncio.gather(*(speak(client, codes[k], k, 7 if k % 2 else 5) for k in streams))
        finally:
            client.close()

    async def main():
        return await asyncio.gather(front_end([0, 1, 2]), front_end([3, 4]))

    results = [audio for group in asyncio.run(main()) for audio in group]
    assert engine.sampling_rate == 24000
    for k, audio in enumerate(results):
        expected = codec.decode(codes[k], seed=k)[0, 0]
        assert audio.dtype == np.float32 and audio.shape == tuple(expected.shape)
        assert snr_db(expected, torch.from_numpy(audio)) >= 100


def test_errors_stay_with_their_stream_and_streams_are_released(engine):
    async def main():
        client = EngineClient(engine.address)
        codes = random_codes({"vq_strides": [4, 2, 1], "codebook_size": 4096}, 4, seed=1)
        ids = ORPHEUS.codes_to_ids(codes).numpy().ravel()
        a, b = await client.open(1), await client.open(2)
        with pytest.raises(ValueError, match="token"):  # checked in the front-end, before anything is sent
            await client.push_ids(a, [5])
        await client.push_ids(b, ids[:14])
        client.release(b)
        with pytest.raises(ValueError, match="no open stream"):
            await client.push_ids(b, ids[14:21])
        # a cancelled await releases its stream, and only it
        task = asyncio.ensure_future(client.push_ids(a, ids[:28]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        c = await client.open(3)
        assert (await client.flush(c)).size == 0
        other = EngineClient(engine.address)
        for _ in range(3):
            await other.open(7)
        held = (await client.stats())["open_streams"]
        other.close()  # a front-end gone: the engine process frees its three
        deadline = time.monotonic() + 10
        while (await client.stats())["open_streams"] > held - 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert (await client.stats())["open_streams"] == held - 3
        with pytest.raises(RuntimeError, match="stream slots"):
            await asyncio.gather(*(client.open(9) for _ in range(9)))
        client.close()

    asyncio.run(main())


def test_an_engine_that_cannot_start_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="failed to start: .*does not exist|failed to start"):
        EngineProcess(str(tmp_path / "missing"), device="cpu", local_files_only=True, model_options=OPTIONS)
