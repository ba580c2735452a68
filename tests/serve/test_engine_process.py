"""snac_fast.serve.engine.process, engine_batcher, engine_client, engine_wire: one engine process (spawned, CPU here) fed by front-ends over a Unix
socket. Every stream's audio equals the offline decode of its codes; errors stay with their stream;
a cancelled await and a front-end that disconnects release their streams."""

import asyncio
import pickle
import time

import numpy as np
import pytest
import torch
from helpers import NARROW, engine64, frames_of, random_codes, upstream64

from snac_fast import FastSNAC
from snac_fast.batching.pcm import PCMBlock
from snac_fast.configs import published_config
from snac_fast.metrics import snr_db
from snac_fast.model.noise import decode_with_keyed_noise
from snac_fast.model.synthetic import make_checkpoint
from snac_fast.orpheus import ORPHEUS
from snac_fast.serve import EngineClient, EngineProcess, ServeSettings
from snac_fast.serve.engine.batcher import EngineBatcher, Front, PushBlock, RowChunk
from snac_fast.serve.engine.wire import OPS, audio_message, push_message, read_audio

OPTIONS = {"fuse": False, "accelerate_encoder": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("engine") / "model", "snac_24khz", **NARROW))


@pytest.fixture(scope="module", params=["auto", "loop"], ids=["threads", "event_loop"])
def engine(checkpoint, request):
    """An engine process of each kind: reader, engine and sender threads (its default), or one event loop."""
    settings = ServeSettings.of(model=checkpoint, device="cpu", max_streams=8, max_batch=4, shared_engine=True,
                                engine_calls=request.param)
    with EngineProcess(settings, output="float32", model_options=OPTIONS) as process:
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
        EngineProcess(ServeSettings.of(model=str(tmp_path / "missing"), device="cpu", local_files_only=True),
                      model_options=OPTIONS)


class CollectingFront(Front):
    """A front-end of the engine process's batcher, in this process: keeps what it is sent."""

    def __init__(self):
        self.streams, self.items = set(), []

    def send(self, message):
        self.items += message

    def send_audio(self, reqs, offsets, pcm):  # through the wire format, as the sender thread sends it
        self.items.append(read_audio(audio_message(reqs, offsets, pcm).tobytes()))


def test_engine_batcher_blocks_keep_each_streams_order_and_fail_only_bad_pushes():
    """The engine process's batcher, in-process on a float64 engine: pushes arrive as blocks (one
    per message). A stream pushed twice in one message runs its pushes in order over two rounds; a
    push to a stream that does not exist fails alone; every stream's audio equals its whole decode."""
    config = {**published_config("snac_24khz"), **NARROW}
    engine = engine64("snac_24khz", streams=4, narrow=True)
    batcher = EngineBatcher(engine, max_batch=2, output="float32")
    front = CollectingFront()
    frames = 5
    codes = [random_codes(config, frames, seed=60 + k) for k in range(3)]
    sids = [batcher.open(20 + k) for k in range(3)]
    strides = config["vq_strides"]

    def row(k, f):
        return engine.row_of(engine.check_codes(frames_of(codes[k], strides, f, f + 1)))

    owner, req = {}, 0
    def push(pushes):  # [(stream index or None for a stream that does not exist, frame)]
        nonlocal req
        reqs = list(range(req, req + len(pushes)))
        for r, (k, _) in zip(reqs, pushes):
            owner[r] = k
        req += len(pushes)
        batcher.take(front, push_message(reqs, [sids[k] if k is not None else 999 for k, _ in pushes], 1,
                                          [row(k or 0, f) for k, f in pushes]))

    push([(0, 0), (1, 0), (0, 1), (None, 0), (2, 0), (0, 2)])  # stream 0 three times in one message
    push([(1, 1), (2, 1), (1, 2), (2, 2)])
    push([(k, f) for f in (3, 4) for k in range(3)])
    batcher.take(front, OPS + pickle.dumps([("flush", 100 + k, sids[k]) for k in range(3)]))
    for k in range(3):
        owner[100 + k] = k
    deadline = time.monotonic() + 60
    while len({i[1] for i in front.items if i[0] == "error"} | {int(r) for i in front.items if i[0] == "audio" for r in i[1]}) < req + 3:
        assert time.monotonic() < deadline, front.items
        time.sleep(0.01)
    batcher.close()
    errors = [i for i in front.items if i[0] == "error"]
    assert [(e[1], e[2]) for e in errors] == [(3, "ValueError")] and "999" in errors[0][3]
    pieces = {}
    for item in front.items:
        if item[0] == "audio":
            _, reqs, offsets, pcm = item
            for j, r in enumerate(reqs.tolist()):
                pieces[r] = pcm[offsets[j]:offsets[j + 1]]
    for k in range(3):  # request numbers rise with each stream's frames: their order is the audio's
        audio = np.concatenate([pieces[r] for r in sorted(pieces) if owner[r] == k])
        expected = decode_with_keyed_noise(upstream64("snac_24khz", True), codes[k], 20 + k)[0, 0]
        assert audio.shape == tuple(expected.shape), k
        assert np.abs(audio - expected.numpy()).max() < 1e-6, k


def _audio_replies(front) -> int:
    return sum(len(i[1]) for i in front.items if i[0] == "audio")


def _wait_for_replies(front, count: int, why: str) -> None:
    deadline = time.monotonic() + 20
    while _audio_replies(front) < count:
        assert time.monotonic() < deadline, why
        time.sleep(0.01)


def test_engine_batcher_max_wait_counts_pushes_not_messages():
    """With ``max_wait_ms`` the engine process's batcher waits for ``max_batch`` pushes, counting
    the pushes inside each front-end message: once the streams have started, two messages of two
    pushes fill a batch of four and run as one call at once, not after the wait (30 s here); a
    stream's first audio waits for nothing."""
    config = {**published_config("snac_24khz"), **NARROW}
    engine = engine64("snac_24khz", streams=4, narrow=True)
    batcher = EngineBatcher(engine, max_batch=4, max_wait_ms=30_000, output="float32")
    front = CollectingFront()
    first_frames = engine.prefill_frames
    codes = [random_codes(config, first_frames + 1, seed=70 + k) for k in range(4)]
    sids = [batcher.open(k) for k in range(4)]
    rows = [engine.row_of(engine.check_codes(c)) for c in codes]
    levels = [c.shape[1] for c in codes[0]]  # a row is level-major: each level's codes in turn
    per_frame = [n // (first_frames + 1) for n in levels]

    def frames_of_row(row, start, stop):
        return np.concatenate([r[start * n:stop * n] for r, n in zip(np.split(row, np.cumsum(levels[:-1])), per_frame)])
    head = [frames_of_row(row, 0, first_frames) for row in rows]
    # one push of a stream yet to start: its first audio, at once
    batcher.take(front, push_message([0], sids[:1], first_frames, np.stack(head[:1])))
    _wait_for_replies(front, 1, "a stream's first audio waited out max_wait_ms")
    batcher.take(front, push_message([1, 2, 3], sids[1:], first_frames, np.stack(head[1:])))
    _wait_for_replies(front, 4, "a first audio waited out max_wait_ms")
    assert all(s.slot.started for s in batcher.table.open.values())
    calls = batcher.batches
    tail = [frames_of_row(row, first_frames, first_frames + 1) for row in rows]
    batcher.take(front, push_message([4, 5], sids[:2], 1, np.stack(tail[:2])))
    time.sleep(0.2)
    assert _audio_replies(front) == 4, "a started stream's push ran before max_wait_ms with the call unfilled"
    batcher.take(front, push_message([6, 7], sids[2:], 1, np.stack(tail[2:])))
    _wait_for_replies(front, 8, "the batcher waited out max_wait_ms with a full batch queued")
    assert batcher.batches == calls + 1
    batcher.intake.stopping = True  # nothing queued: stop without the 30 s wait
    batcher.close()


def test_one_call_of_several_front_ends_replies_to_each_with_its_own_pushes():
    """Blocks of three front-ends, queued interleaved, joined into one call: each front-end's pushes
    side by side (its reply one slice of the call's PCM), each push's row with it, and the replies
    carry each front-end's request numbers with their own audio."""
    fronts = [CollectingFront() for _ in range(3)]
    order = [0, 1, 0, 2, 1, 0]  # the front-end of each queued block
    blocks, want = [], {}
    for b, k in enumerate(order):
        reqs = np.arange(3) + 10 * b + 100 * k
        rows = np.stack([np.full(4, r) for r in reqs])  # a row tells its request
        blocks.append(PushBlock(fronts[k], reqs, [object() for _ in reqs], 1, rows))
        want.update({int(r): (k, np.full(5, r, np.int16)) for r in reqs})
    block, front_of, joined_fronts = PushBlock.joined(blocks)
    assert joined_fronts == fronts and front_of.tolist() == sorted(front_of.tolist())
    assert np.array_equal(block.rows[:, 0], block.reqs)  # rows moved with their pushes
    chunk = RowChunk(block, front_of, joined_fronts, 0, len(block))
    pcm = np.concatenate([want[int(r)][1] for r in chunk.reqs])  # the call's audio, in its order
    batcher = EngineBatcher.__new__(EngineBatcher)
    batcher.deliver(chunk, PCMBlock(pcm, np.arange(len(chunk) + 1, dtype=np.int64) * 5))
    for k, front in enumerate(fronts):
        assert len(front.items) == 1  # one reply per front-end and call
        _, reqs, offsets, audio = front.items[0]
        assert sorted(reqs.tolist()) == sorted(r for r, (owner, _) in want.items() if owner == k)
        for j, r in enumerate(reqs.tolist()):
            assert np.array_equal(audio[offsets[j]:offsets[j + 1]], want[r][1])


@pytest.mark.gpu
def test_gpu_one_engine_process_per_gpu_each_exact(checkpoint):
    """Engine processes on cuda:0 and cuda:1 (float32), both fed at once: each stream's audio
    equals the offline decode on that GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (a two-GPU device kind)")
    codec = FastSNAC.from_pretrained(checkpoint, device="cuda:0", dtype=torch.float32)
    codes = [random_codes(codec.config, 8, seed=300 + k) for k in range(4)]
    def on(device):
        return ServeSettings.of(model=checkpoint, device=device, dtype="float32", max_streams=4, max_batch=4)
    with EngineProcess(on("cuda:0"), output="float32") as first, EngineProcess(on("cuda:1"), output="float32") as second:
        assert (first.info["device"], second.info["device"]) == ("cuda:0", "cuda:1")

        async def front_end(process, streams):
            client = EngineClient(process.address)
            try:
                return await asyncio.gather(*(speak(client, codes[k], k) for k in streams))
            finally:
                client.close()

        async def main():
            return await asyncio.gather(front_end(first, [0, 1]), front_end(second, [2, 3]))

        results = [audio for group in asyncio.run(main()) for audio in group]
    for k, audio in enumerate(results):
        expected = codec.decode([c.cuda() for c in codes[k]], seed=k)[0, 0].cpu()
        assert audio.shape == tuple(expected.shape)
        assert snr_db(expected, torch.from_numpy(audio)) >= 100
