"""The batchers (snac_fast.batching.batchers): exact audio through them, every output form, and the faults a
server meets: a cancelled await, an idle client, pushes after the end, a bad id, an engine call that
fails. The engine is upstream's float64 model on the CPU (torch ops), so a stream equals the whole
decode to float64 rounding and a mistake shows as a large error."""

import asyncio
import math
import threading
import time

import numpy as np
import pytest
import torch
from helpers import NARROW, engine64, frames_of, random_codes, upstream64

from snac_fast.batching.intake import Intake
from snac_fast.configs import published_config
from snac_fast.metrics import snr_db
from snac_fast.model.noise import decode_with_keyed_noise
from snac_fast.model.synthetic import synthetic_model
from snac_fast.orpheus import ORPHEUS
from snac_fast.serve import AsyncStreamBatcher, PCMBlock, StreamBatcher
from snac_fast.streaming import StreamEngine

NAME = "snac_24khz"
CONFIG = published_config(NAME)
STRIDES = CONFIG["vq_strides"]


def expected_audio(codes, seed, narrow=True):
    return decode_with_keyed_noise(upstream64(NAME, narrow), codes, seed)[0, 0]


def as_tensor(piece):
    return torch.from_numpy(np.asarray(piece)).double() if isinstance(piece, np.ndarray) else piece.double()


def test_thread_batcher_no_cross_talk():
    codes = [random_codes(CONFIG, 6 + i, seed=20 + i) for i in range(4)]
    expected = [expected_audio(c, 50 + i, narrow=False) for i, c in enumerate(codes)]
    results = {}
    with StreamBatcher(engine64(NAME), max_batch=4, max_wait_ms=20) as batcher:
        def run(i):
            sid = batcher.open(50 + i)
            pieces = [batcher.push(sid, frames_of(codes[i], STRIDES, f, f + 1)) for f in range(6 + i)]
            results[i] = torch.cat(pieces + [batcher.flush(sid)])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert batcher.batches < sum(6 + i + 1 for i in range(4))  # requests were batched
        sid = batcher.open(1)
        with pytest.raises(ValueError, match="do not follow vq_strides"):
            batcher.push(sid, [codes[0][0][:, :1], codes[0][1][:, :1], codes[0][2][:, :4]])
    for i in range(4):
        assert (results[i] - expected[i]).abs().max().item() < 1e-12, f"stream {i}"


@pytest.mark.parametrize("engine_thread", [False, True])
def test_async_batcher_ordering_and_errors(engine_thread):
    codes = [random_codes(CONFIG, 6, seed=30 + i) for i in range(3)]
    expected = [expected_audio(c, i, narrow=False) for i, c in enumerate(codes)]

    async def main():
        batcher = AsyncStreamBatcher(engine64(NAME), max_batch=8, max_wait_ms=5, layout=ORPHEUS, engine_thread=engine_thread)

        async def one(i):
            sid = batcher.open(i)
            ids = ORPHEUS.codes_to_ids(codes[i])
            # pushes of one stream queued back to back: they must run in order
            parts = await asyncio.gather(*(batcher.push_ids(sid, ids[j:j + 7]) for j in range(0, ids.numel(), 7)))
            return torch.cat(list(parts) + [await batcher.flush(sid)])

        outs = await asyncio.gather(*(one(i) for i in range(3)))
        sid = batcher.open(0)
        with pytest.raises(ValueError, match="not a code of frame slot"):
            await batcher.push_ids(sid, torch.tensor([1, 2, 3]))
        await batcher.__aexit__(None, None, None)
        return outs

    outs = asyncio.run(main())
    for i in range(3):
        assert (outs[i] - expected[i]).abs().max().item() < 1e-12


@pytest.mark.parametrize("output", ["tensor", "float32", "int16"])
def test_async_batcher_outputs_exact_audio_in_every_form(output):
    """Ten staggered streams, ids cut anywhere (inside frames too), chunks of 3 streams per engine
    call: each stream's audio equals its whole decode (int16: its rounding of it)."""
    streams, frames = 10, 7
    codes = [random_codes(CONFIG, frames, seed=40 + i) for i in range(streams)]
    expected = [expected_audio(c, 100 + i) for i, c in enumerate(codes)]

    async def main():
        batcher = AsyncStreamBatcher(engine64(NAME, streams=8, narrow=True), max_batch=3, layout=ORPHEUS, output=output)

        async def one(i):
            await asyncio.sleep(0.002 * i)
            sid = batcher.open(100 + i)
            ids, pieces, at = ORPHEUS.codes_to_ids(codes[i]).tolist(), [], 0
            for n in [5, 9, 7, 1, 13, 7, 7]:
                pieces.append(await batcher.push_ids(sid, ids[at:at + n]))
                at += n
            assert at == len(ids)
            pieces.append(await batcher.flush(sid))
            return pieces

        async with batcher:
            # 10 streams on 8 slots: the last two open once earlier ones finish
            first = await asyncio.gather(*(one(i) for i in range(8)))
            rest = await asyncio.gather(*(one(i) for i in range(8, streams)))
            assert batcher.batches > 0 and batcher.open_streams == 0
        return first + rest

    outs = asyncio.run(main())
    for i, pieces in enumerate(outs):
        if output == "tensor":
            assert all(isinstance(p, torch.Tensor) for p in pieces)
        else:
            assert all(isinstance(p, np.ndarray) and p.dtype == np.dtype(output) and p.ndim == 1 for p in pieces)
        got = torch.cat([as_tensor(p) for p in pieces])
        assert got.shape == expected[i].shape, f"stream {i}"
        if output == "int16":
            want = (expected[i].float() * 32767).round().clamp(-32768, 32767)
            assert (got - want).abs().max().item() <= 1, f"stream {i}"
        else:
            tolerance = 1e-12 if output == "tensor" else 1e-6  # float32 rounding of float64 audio
            assert (got - expected[i]).abs().max().item() < tolerance, f"stream {i}"


@pytest.mark.parametrize("engine_thread", [False, True])
def test_cancelled_await_releases_only_its_stream(engine_thread):
    """A web framework cancels the handler of a client that disconnected: its stream is released
    (the slot freed, later pushes refused) while the other streams of the same batches go on."""
    frames = 8
    codes = [random_codes(CONFIG, frames, seed=60 + i) for i in range(4)]
    expected = [expected_audio(c, i) for i, c in enumerate(codes)]
    engine = engine64(NAME, streams=4, narrow=True)

    async def main():
        batcher = AsyncStreamBatcher(engine, max_batch=4, layout=ORPHEUS, output="float32", engine_thread=engine_thread)
        sids = [batcher.open(i) for i in range(4)]
        cancelled = asyncio.Event()

        async def one(i):
            ids = ORPHEUS.codes_to_ids(codes[i]).tolist()
            pieces = []
            for f in range(frames):
                push = asyncio.ensure_future(batcher.push_ids(sids[i], ids[7 * f:7 * f + 7]))
                if i == 2 and f == 5:
                    await asyncio.sleep(0)  # the push is queued and awaited: then its client goes
                    push.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await push
                    cancelled.set()
                    return None
                pieces.append(await push)
            pieces.append(await batcher.flush(sids[i]))
            return np.concatenate(pieces)

        outs = await asyncio.gather(*(one(i) for i in range(4)))
        assert cancelled.is_set()
        with pytest.raises(ValueError, match="stream 2 has ended .released."):
            await batcher.push_ids(sids[2], [0] * 7)
        await asyncio.sleep(0.05)
        assert engine.open_streams == 0  # the cancelled stream's slot came back too
        sid = batcher.open(9)  # and the batcher serves on
        assert (await batcher.push_ids(sid, ORPHEUS.codes_to_ids(codes[0]).tolist())).size > 0
        batcher.close()
        return outs

    outs = asyncio.run(main())
    assert outs[2] is None
    for i in (0, 1, 3):
        assert np.abs(outs[i] - expected[i].numpy()).max() < 1e-6, f"stream {i}"


def test_a_push_in_flight_is_not_idle():
    """Streams whose pushes wait longer than the idle timeout for a busy engine are not released
    under them (seen on a slow CI machine: streams dropped mid-request)."""
    engine = engine64(NAME, streams=2, narrow=True)
    real_step = engine.step_rows

    def slow_step(*args):
        time.sleep(0.5)
        return real_step(*args)

    engine.step_rows = slow_step
    codes = [random_codes(CONFIG, 5, seed=71 + i) for i in range(2)]
    ids = [ORPHEUS.codes_to_ids(c).tolist() for c in codes]
    with StreamBatcher(engine, layout=ORPHEUS, idle_timeout_s=0.2, output="float32") as batcher:
        sids = [batcher.open(3 + i) for i in range(2)]
        pieces = [[], []]
        for f in range(5):
            first = batcher.submit_ids(sids[0], ids[0][7 * f:7 * f + 7])
            time.sleep(0.05)  # the second stream's push queues while the first one's step runs
            pieces[1].append(batcher.push_ids(sids[1], ids[1][7 * f:7 * f + 7]))
            pieces[0].append(first.result())
        for i in range(2):
            pieces[i].append(batcher.flush(sids[i]))
        assert batcher.idle_released == 0
    for i in range(2):
        assert np.abs(np.concatenate(pieces[i]) - expected_audio(codes[i], 3 + i).numpy()).max() < 1e-6


def test_idle_stream_is_released_and_pushes_after_the_end_are_refused():
    engine = engine64(NAME, streams=2, narrow=True)
    codes = random_codes(CONFIG, 6, seed=70)
    ids = ORPHEUS.codes_to_ids(codes).tolist()
    with StreamBatcher(engine, layout=ORPHEUS, idle_timeout_s=0.2) as batcher:
        idle = batcher.open(1)
        batcher.push_ids(idle, ids[:14])
        busy = batcher.open(2)
        started = time.monotonic()
        # busy keeps pushing (a frame every two pushes): never idle. Past the 0.2 s, as long as a
        # loaded machine takes to run the pushes (a 2-core CI machine running other tests: > 0.6 s)
        while time.monotonic() < started + 0.6 or (batcher.idle_released == 0 and time.monotonic() < started + 20):
            batcher.push_ids(busy, ids[:3])
            batcher.push_ids(busy, ids[3:7])
            time.sleep(0.02)
        assert batcher.idle_released == 1 and engine.open_streams == 1
        with pytest.raises(ValueError, match="idle for over 0.2 s"):
            batcher.push_ids(idle, ids[14:21])
        batcher.flush(busy)
        with pytest.raises(ValueError, match="has ended .flushed."):
            batcher.push_ids(busy, ids[:7])
        with pytest.raises(ValueError, match="has ended .flushed."):
            batcher.flush(busy)
        with pytest.raises(ValueError, match="no open stream 99"):
            batcher.push_ids(99, ids[:7])
        assert engine.open_streams == 0
    with pytest.raises(RuntimeError, match="closed"):
        batcher.open(3)


@pytest.mark.parametrize("engine_thread", [False, True])
def test_bad_id_fails_only_its_push_and_the_stream_goes_on(engine_thread):
    codes = [random_codes(CONFIG, 6, seed=80 + i) for i in range(2)]
    expected = [expected_audio(c, i) for i, c in enumerate(codes)]

    async def main():
        batcher = AsyncStreamBatcher(engine64(NAME, streams=2, narrow=True), layout=ORPHEUS, output="float32",
                                     engine_thread=engine_thread)
        sids = [batcher.open(i) for i in range(2)]
        ids = [ORPHEUS.codes_to_ids(c).tolist() for c in codes]
        pieces = [[], []]
        for f in range(6):
            bad = list(ids[0][7 * f:7 * f + 7])
            bad[3] = 5  # not a code of slot 3
            if f == 2:
                results = await asyncio.gather(batcher.push_ids(sids[0], bad), batcher.push_ids(sids[1], ids[1][7 * f:7 * f + 7]),
                                               return_exceptions=True)
                assert isinstance(results[0], ValueError) and "token 17" in str(results[0])
                pieces[1].append(results[1])
            else:
                pieces[1].append(await batcher.push_ids(sids[1], ids[1][7 * f:7 * f + 7]))
            pieces[0].append(await batcher.push_ids(sids[0], ids[0][7 * f:7 * f + 7]))
        outs = [np.concatenate(p + [await batcher.flush(s)]) for p, s in zip(pieces, sids)]
        batcher.close()
        return outs

    outs = asyncio.run(main())
    for i in range(2):
        assert np.abs(outs[i] - expected[i].numpy()).max() < 1e-6, f"stream {i}"


def test_failed_engine_call_fails_its_streams_and_the_engine_serves_on(monkeypatch):
    """An out-of-memory in a step: the streams of that call get the error and are released; the
    batcher's thread lives, and other streams (before and after) decode exactly."""
    engine = engine64(NAME, streams=4, narrow=True)
    codes = [random_codes(CONFIG, 6, seed=90 + i) for i in range(3)]
    expected = [expected_audio(c, i) for i, c in enumerate(codes)]
    real_step = engine.step_rows
    failing = {"slot": None}

    def step_rows(streams, rows, frames):
        if any(s is failing["slot"] for s in streams):
            failing["slot"] = None
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_step(streams, rows, frames)

    monkeypatch.setattr(engine, "step_rows", step_rows)
    with StreamBatcher(engine, max_batch=1, output="float32") as batcher:
        sids = [batcher.open(i) for i in range(2)]
        outs = {0: [], 1: []}
        for f in range(6):
            if f == 3:
                failing["slot"] = batcher.table.open[sids[0]].slot
                futures = [batcher.submit(s, frames_of(codes[i], STRIDES, f, f + 1)) for i, s in enumerate(sids)]
                with pytest.raises(torch.OutOfMemoryError):
                    futures[0].result()
                outs[1].append(futures[1].result())
                continue
            for i, s in enumerate(sids):
                if i == 0 and f > 3:
                    with pytest.raises(ValueError, match="engine call failed: OutOfMemoryError"):
                        batcher.push(s, frames_of(codes[i], STRIDES, f, f + 1))
                    continue
                outs[i].append(batcher.push(s, frames_of(codes[i], STRIDES, f, f + 1)))
        outs[1].append(batcher.flush(sids[1]))
        assert batcher.failed_calls == 1 and engine.open_streams == 0
        late = batcher.open(2)
        pieces = [batcher.push(late, frames_of(codes[2], STRIDES, f, f + 1)) for f in range(6)] + [batcher.flush(late)]
    assert np.abs(np.concatenate(outs[1]) - expected[1].numpy()).max() < 1e-6
    assert np.abs(np.concatenate(pieces) - expected[2].numpy()).max() < 1e-6


def test_an_error_of_the_engine_thread_fails_what_waits_and_it_serves_on(monkeypatch):
    """A bug in the engine thread's own work (not an engine call): the requests it held get the
    error instead of hanging, and the thread lives on to serve the next pushes exactly."""
    engine = engine64(NAME, streams=2, narrow=True)
    codes = random_codes(CONFIG, 4, seed=7)
    with StreamBatcher(engine, max_batch=2, output="float32") as batcher:
        real_split = batcher.split_round
        broken = {"once": True}

        def split_round(batch):
            if broken.pop("once", False):
                raise KeyError("a bug of the batcher")
            return real_split(batch)

        monkeypatch.setattr(batcher, "split_round", split_round)
        sid = batcher.open(3)
        with pytest.raises(RuntimeError, match="the batcher failed: KeyError"):
            batcher.submit(sid, frames_of(codes, STRIDES, 0, 1)).result(timeout=30)
        late = batcher.open(4)
        pieces = [batcher.submit(late, frames_of(codes, STRIDES, f, f + 1)).result(timeout=30) for f in range(4)]
        pieces.append(batcher.flush(late))
    assert np.abs(np.concatenate(pieces) - expected_audio(codes, 4).numpy()).max() < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("engine_thread", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_batcher_streams_equal_decodes(cuda, no_tf32, dtype, engine_thread):
    """Twelve staggered streams through CUDA graphs, chunks of 4 streams per engine call, host
    PCM: float32 equals the whole decode (>= 100 dB); float16 as int16 PCM stays at fp16's
    distance from the fp16 decode (>= 50 dB), every length exact."""
    from snac_fast import FastSNAC

    codec = FastSNAC.from_pretrained("synthetic:snac_24khz", device=cuda, dtype=dtype)
    engine = codec.stream_engine(max_streams=16)
    engine.warmup(max_batch=4)
    output = "float32" if dtype == torch.float32 else "int16"
    streams, frames = 12, 9
    codes = [random_codes(CONFIG, frames, seed=200 + i) for i in range(streams)]

    async def main():
        batcher = AsyncStreamBatcher(engine, max_batch=4, layout=ORPHEUS, output=output, engine_thread=engine_thread)

        async def one(i):
            await asyncio.sleep(0.001 * i)
            sid = batcher.open(300 + i)
            ids, pieces = ORPHEUS.codes_to_ids(codes[i]).tolist(), []
            for f in range(frames):
                pieces.append(await batcher.push_ids(sid, ids[7 * f:7 * f + 7]))
            pieces.append(await batcher.flush(sid))
            return np.concatenate(pieces)

        async with batcher:
            return await asyncio.gather(*(one(i) for i in range(streams)))

    outs = asyncio.run(main())
    for i in range(streams):
        want = codec.decode([c.to(cuda) for c in codes[i]], seed=300 + i)[0, 0].float().cpu()
        got = torch.from_numpy(outs[i]).float()
        assert got.shape == want.shape, f"stream {i}"
        if dtype == torch.float32:
            assert snr_db(want, got) >= 100, f"stream {i}"
        else:
            assert snr_db(want * 32767, got) >= 50, f"stream {i}"


def test_batcher_on_the_event_loop_idles_out_fails_and_closes_from_another_thread():
    """The default AsyncStreamBatcher runs its engine calls on the event loop's thread: a stream no
    push touched for the idle timeout is released by the loop's own timer; an out-of-memory in one
    engine call fails only that call's streams; max_wait_ms gathers streams into one call; a push
    from a second event loop is refused by name; close() from another thread runs what is queued."""
    engine = engine64(NAME, streams=4, narrow=True)
    codes = [random_codes(CONFIG, 4, seed=110 + i) for i in range(3)]
    ids = [ORPHEUS.codes_to_ids(c).tolist() for c in codes]
    real_step, failing = engine.step_rows, {"slot": None}

    def step_rows(streams, rows, frames):
        if any(s is failing["slot"] for s in streams):
            failing["slot"] = None
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_step(streams, rows, frames)

    engine.step_rows = step_rows

    async def main():
        batcher = AsyncStreamBatcher(engine, max_batch=4, max_wait_ms=50, layout=ORPHEUS, output="float32", idle_timeout_s=0.3)
        assert not batcher.engine_thread and type(batcher.driver).__name__ == "LoopDriver"  # no engine thread
        sids = [batcher.open(i) for i in range(3)]
        idle = batcher.open(7)
        calls = batcher.batches
        first = await asyncio.gather(*(batcher.push_ids(s, ids[i][:7]) for i, s in enumerate(sids)))
        assert batcher.batches == calls + 1  # the three pushes waited for each other: one call
        failing["slot"] = batcher.table.open[sids[0]].slot
        second = await asyncio.gather(*(batcher.push_ids(s, ids[i][7:14]) for i, s in enumerate(sids)), return_exceptions=True)
        assert isinstance(second[0], torch.OutOfMemoryError) and batcher.failed_calls == 1
        assert not batcher.is_open(sids[0]) and not batcher.is_open(sids[1])  # the call's streams, released
        with pytest.raises(ValueError, match="engine call failed: OutOfMemoryError"):
            await batcher.push_ids(sids[0], ids[0][14:21])
        late = batcher.open(2)
        pieces = [await batcher.push_ids(late, ids[2][j:j + 7]) for j in range(0, len(ids[2]), 7)]
        started = time.monotonic()
        while batcher.is_open(idle) and time.monotonic() < started + 10:
            await asyncio.sleep(0.05)
        assert batcher.idle_released >= 1 and not batcher.is_open(idle)
        with pytest.raises(ValueError, match="idle for over 0.3 s"):
            await batcher.push_ids(idle, ids[0][:7])

        other_loop = []

        def push_from_another_loop():
            async def push():
                await batcher.push_ids(batcher.open(9), ids[0][:7])
            try:
                asyncio.run(push())
            except RuntimeError as error:
                other_loop.append(error)
        thread = threading.Thread(target=push_from_another_loop)
        thread.start()
        await asyncio.get_running_loop().run_in_executor(None, thread.join)
        assert other_loop and "engine_thread=True" in str(other_loop[0])

        final = asyncio.ensure_future(batcher.flush(late))
        await asyncio.sleep(0)  # queued, not yet run: close() from another thread runs it first
        await asyncio.get_running_loop().run_in_executor(None, batcher.close)
        pieces.append(await final)
        with pytest.raises(RuntimeError, match="closed"):
            batcher.open(3)
        return first, np.concatenate(pieces)

    first, late_audio = asyncio.run(main())
    assert engine.open_streams == 0
    assert np.abs(late_audio - expected_audio(codes[2], 2).numpy()).max() < 1e-6
    assert all(isinstance(f, np.ndarray) and f.dtype == np.float32 for f in first)


def test_batcher_on_the_event_loop_moves_to_the_next_asyncio_run():
    """A script or notebook that calls asyncio.run several times with one batcher: each run's loop
    takes over once the last one has closed; its streams go on exactly."""
    codes = random_codes(CONFIG, 6, seed=120)
    ids = ORPHEUS.codes_to_ids(codes).tolist()
    engine = engine64(NAME, streams=2, narrow=True)
    batcher = AsyncStreamBatcher(engine, layout=ORPHEUS, output="float32", idle_timeout_s=60)
    sid, gone = batcher.open(5), batcher.open(6)

    first = asyncio.run(batcher.push_ids(sid, ids[:21]))
    batcher.release(gone)  # between the runs, no loop running: queued for the next one
    assert engine.open_streams == 2
    second = asyncio.run(batcher.push_ids(sid, ids[21:]))

    async def rest():
        return await batcher.flush(sid)
    audio = np.concatenate([first, second, asyncio.run(rest())])
    assert engine.open_streams == 0 and not batcher.is_open(gone)  # the release ran on a later loop
    batcher.close()
    assert np.abs(audio - expected_audio(codes, 5).numpy()).max() < 1e-6


def _serve_in_process(first_seed: int, codes: list) -> list:
    """A worker process of a multi-process server: its own engine and batcher (see docs/batching.md)."""
    async def main():
        async with AsyncStreamBatcher(engine64(NAME, streams=2, narrow=True), layout=ORPHEUS, output="float32") as batcher:
            async def one(i, stream_codes):
                sid = batcher.open(first_seed + i)
                ids = ORPHEUS.codes_to_ids(stream_codes).tolist()
                pieces = [await batcher.push_ids(sid, ids[j:j + 7]) for j in range(0, len(ids), 7)]
                return np.concatenate(pieces + [await batcher.flush(sid)])
            return await asyncio.gather(*(one(i, c) for i, c in enumerate(codes)))
    return asyncio.run(main())


def test_one_engine_per_worker_process():
    """How a host uses its cores: worker processes (spawned, as uvicorn --workers and
    multiprocessing do), each with its own engine and batcher; each stream's audio is exact."""
    import multiprocessing

    codes = [[random_codes(CONFIG, 5, seed=400 + 2 * w + i) for i in range(2)] for w in range(2)]
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        outs = pool.starmap(_serve_in_process, [(10 * w, codes[w]) for w in range(2)])
    for w in range(2):
        for i in range(2):
            want = expected_audio(codes[w][i], 10 * w + i).numpy()
            assert np.abs(outs[w][i] - want).max() < 1e-6, f"worker {w} stream {i}"


def test_int16_output_of_a_float32_engine_is_the_rounding_of_its_float32_output():
    """A float32 engine's audio is converted to int16 without touching the engine's own tensor
    (its steady-state steps return inference tensors that an in-place scale refuses, or would
    corrupt): two batchers on twin engines, pushed the same codes, one asked for float32 PCM and one
    for int16, agree to the rounding."""
    streams, frames = 3, 9
    codes = [random_codes(CONFIG, frames, seed=70 + i) for i in range(streams)]
    outputs = {}
    for output in ("float32", "int16"):
        engine = StreamEngine(synthetic_model(NAME, **NARROW), {**CONFIG, **NARROW}, streams, dtype=torch.float32)
        with StreamBatcher(engine, max_batch=streams, output=output) as batcher:
            sids = [batcher.open(10 + i) for i in range(streams)]
            pieces = [[] for _ in range(streams)]
            for f in range(frames):
                futures = [batcher.submit(sid, frames_of(codes[i], STRIDES, f, f + 1)) for i, sid in enumerate(sids)]
                for i, future in enumerate(futures):
                    pieces[i].append(future.result())
            for i, sid in enumerate(sids):
                pieces[i].append(batcher.flush(sid))
        outputs[output] = [np.concatenate(p) for p in pieces]
    for i in range(streams):
        want = np.clip(np.round(outputs["float32"][i].astype(np.float64) * 32767), -32768, 32767)
        assert outputs["int16"][i].dtype == np.int16 and outputs["int16"][i].shape == want.shape
        assert np.abs(outputs["int16"][i] - want).max() <= 1, f"stream {i}"
    assert np.abs(outputs["float32"][0]).max() > 1e-3  # audio, not silence


@pytest.mark.parametrize("sizes", [[5, 5, 5, 5], [3, 0, 7, 2, 9], [2, 1, 3]])  # the last: as long as 3 of the first
def test_pcm_block_pieces_and_spans(sizes):
    """One engine call's PCM handed out whole: its pieces as a sequence, and any run of them end to
    end with their offsets (the engine process's reply to one front-end), as views."""
    pcm = np.random.default_rng(len(sizes)).integers(-32768, 32767, sum(sizes)).astype(np.int16)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    block = PCMBlock(pcm, offsets)
    pieces = np.split(pcm, offsets[1:-1])
    assert len(block) == len(sizes)
    assert all(np.array_equal(a, b) for a, b in zip(block, pieces, strict=True))
    assert np.array_equal(block[len(sizes) - 1], pieces[-1])
    with pytest.raises(IndexError):
        block[len(sizes)]
    for start, stop in [(0, 1), (1, len(sizes)), (0, len(sizes)), (2, 2)]:
        got, got_offsets = block.span(start, stop)
        assert np.array_equal(got, np.concatenate(pieces[start:stop]) if stop > start else pcm[:0])
        assert got_offsets.tolist() == [0, *np.cumsum(sizes[start:stop]).tolist()]
        assert got.base is not None and np.shares_memory(got, pcm) or got.size == 0  # a view, no copy


@pytest.mark.parametrize("engine_thread", [False, True])
def test_a_first_audio_never_waits_for_fuller_calls(engine_thread):
    """``max_wait_ms`` holds a started stream's push for a fuller call, never the push a stream's
    first audio waits on (its prefill), on the loop's driver and on the thread's."""
    engine = engine64(NAME, streams=2, narrow=True)
    codes = random_codes(CONFIG, engine.prefill_frames + 1, seed=5)
    ids = ORPHEUS.codes_to_ids(codes).tolist()
    first = 7 * engine.prefill_frames

    async def main():
        batcher = AsyncStreamBatcher(engine, max_batch=4, max_wait_ms=30_000, layout=ORPHEUS, output="float32",
                                     engine_thread=engine_thread)
        sid = batcher.open(3)
        started = time.monotonic()
        audio = await asyncio.wait_for(batcher.push_ids(sid, ids[:first]), 10)
        assert time.monotonic() - started < 5 and len(audio) > 0  # not held for 30 s
        later = asyncio.ensure_future(batcher.push_ids(sid, ids[first:]))
        await asyncio.sleep(0.5)
        assert not later.done()  # a started stream's push waits for fuller calls
        if engine_thread:
            await asyncio.get_running_loop().run_in_executor(None, batcher.close)
        else:
            batcher.close()  # runs what is queued
        return np.concatenate([audio, await later])

    audio = asyncio.run(main())
    want = expected_audio(codes, 3).numpy()[:len(audio)]
    assert len(audio) > 0 and np.abs(audio - want).max() < 1e-6


def test_the_intake_launches_an_unfilled_round_max_wait_after_the_last_or_at_once_for_a_first_audio(monkeypatch):
    """The launch rule of :class:`Intake`, on a clock of our own: a round waits for fuller calls
    only while max_wait_ms is set, items are pending, the batcher is not stopping and fewer pushes
    (blocks count each of theirs, carried ones too) are queued than a call takes; its deadline is
    max_wait_ms after the last round, or the oldest first-audio push's queueing if sooner."""
    clock = [100.0]
    monkeypatch.setattr("snac_fast.batching.intake.time.monotonic", lambda: clock[0])
    intake = Intake(max_batch=4, max_wait_ms=50, count_pushes=lambda items: sum(map(len, items)))
    assert not intake.wants_more([]) and len(intake) == 0  # nothing pending
    assert intake.deadline() == -math.inf  # no round yet: the first launches at once
    intake.put([1], 100.0, first_audio=False)
    assert intake.wants_more([]) and intake.wants_more([[2, 3]]) and not intake.wants_more([[2, 3, 4]])
    assert intake.take() == [[1]] and len(intake) == 0
    clock[0] = 100.01
    intake.put([1, 2], 100.01, first_audio=False)
    assert intake.deadline() == pytest.approx(100.05)  # max_wait_ms after the last round, not after the push
    intake.put([3], 100.02, first_audio=True)
    intake.put([4], 100.03, first_audio=True)
    assert intake.deadline() == 100.02 and not intake.wants_more([])  # the oldest first audio; 4 pushes fill a call
    assert intake.take() == [[1, 2], [3], [4]] and intake.deadline() == pytest.approx(100.06)  # first audio's claim spent
    intake.put([5], 100.02, first_audio=False)
    intake.stopping = True
    assert not intake.wants_more([])  # closing: whatever is queued runs now
    assert not Intake(max_batch=4, max_wait_ms=0, count_pushes=len).wants_more([])  # no wait set


def test_the_stream_table_says_why_a_stream_is_gone_and_opens_none_once_closed(monkeypatch):
    """A batcher's table of streams: ids in order, each with a framer of the layout; a stream that
    ended is refused by name (flushed, released, ...) while its reason is among the most recent
    ENDED_KEPT, by id after; ending twice keeps the first reason; idle streams are those without a
    push in flight; once closed it hands back the open streams and opens none."""
    from snac_fast.batching import streams as table_module
    from snac_fast.batching.streams import StreamTable

    monkeypatch.setattr(table_module, "ENDED_KEPT", 2)
    table = StreamTable(ORPHEUS)
    a, b, c, d = (table.add(object()) for _ in range(4))
    assert [s.id for s in (a, b, c, d)] == [0, 1, 2, 3] and a.framer is not None and len(table) == 4
    table.end(a, "flushed")
    table.end(a, "released", drop=True)
    assert a.ended == "flushed" and a.dropped and 0 not in table and len(table) == 3
    with pytest.raises(ValueError, match=r"stream 0 has ended \(flushed\)"):
        table.get(0)
    table.end(b, "released")
    table.end(c, "idle")
    with pytest.raises(ValueError, match="no open stream 0"):  # its reason made way for newer ones
        table.get(0)
    with pytest.raises(ValueError, match=r"stream 2 has ended \(idle\)"):
        table.get(2)
    d.queued, d.done = 1, 0  # a push in flight: not idle however old
    assert table.idle(time.monotonic() + 1) == []
    d.done = 1
    assert table.idle(time.monotonic() + 1) == [d] and table.idle(d.last_active) == []
    assert table.close() == [d] and table.close() is None and len(table) == 0
    assert table.add(object()) is None
    with pytest.raises(RuntimeError, match="closed"):
        table.get(3)
    assert StreamTable(None).add(object()).framer is None


@pytest.mark.gpu
@pytest.mark.parametrize("output", ["int16", "float32"])
def test_host_copies_bring_each_calls_pcm_and_reuse_their_buffers(cuda, output):
    """A CUDA engine call's audio converted on the device and copied through pinned buffers: each
    call's PCM exact (int16 as int16_pcm rounds it), a buffer taken again once its PCM is copied
    out, a call larger than a buffer given a larger one, the GPU time counted."""
    from snac_fast.batching.pcm import HostCopies, int16_pcm, pcm_of

    copies = HostCopies(cuda, output, 4096, torch.float16)
    rng = torch.Generator(device=cuda).manual_seed(3)
    last = None  # the buffer the previous call's PCM came through: free again, so taken next
    for size in (4096, 1000, 9000, 4096):
        audio = (torch.rand(size, device=cuda, generator=rng, dtype=torch.float32) * 2 - 1).half()
        begun = copies.begin()
        host, copied = copies.start(pcm_of(audio, output))
        assert host.is_pinned() and host.numel() >= size
        if last is not None and size <= last.numel():
            assert host.data_ptr() == last.data_ptr()
        offsets = np.array([0, size // 3, size], dtype=np.int64)
        block = copies.block(host, copied, begun, offsets)
        want = (int16_pcm(audio) if output == "int16" else audio.float()).cpu().numpy()
        assert block.pcm.dtype == want.dtype and np.array_equal(block.pcm, want)
        last = host
    assert copies.gpu_seconds > 0
