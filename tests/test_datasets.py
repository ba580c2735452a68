"""Corpus encode/decode (snac_fast.datasets): inputs of every kind, per-file errors recorded, codes
independent of batching, resume after a crash, and the way back to audio."""

import json
import math
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile
import torch
from helpers import NARROW

from snac_fast import FastSNAC
from snac_fast import datasets as ds
from snac_fast.configs import published_config
from snac_fast.model.synthetic import make_checkpoint, speech_like, synthetic_model


@pytest.fixture(scope="module")
def codec():  # the pipeline is under test, not the kernels: upstream layers run (no interpreter)
    return FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu", source="synthetic:narrow",
                    accelerate_encoder=False, fuse=False)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "sub").mkdir()
    soundfile.write(root / "a.wav", speech_like(1.3, 24000, 0), 24000)
    soundfile.write(root / "sub" / "b.flac", np.stack([speech_like(0.7, 44100, 1), speech_like(0.7, 44100, 2)], 1), 44100)
    soundfile.write(root / "c_short.wav", speech_like(0.1, 24000, 3), 24000)
    soundfile.write(root / "d_empty.wav", np.zeros(0, np.float32), 24000)
    (root / "e_corrupt.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt garbage")
    (root / "f_notes.txt").write_text("not audio")
    soundfile.write(root / "g.wav", speech_like(2.2, 16000, 4), 16000)
    (root / ".hidden.wav").write_bytes(b"ignored")
    return root


def rows_of(out):
    return {r["id"]: r for r in ds.read_shards(out)}


def test_encode_folder_records_every_file(codec, corpus, tmp_path):
    summary = ds.encode_dataset(corpus, tmp_path / "out", codec, files_per_shard=3, pad_seconds=0.5, progress=False)
    rows = rows_of(tmp_path / "out")
    assert sorted(rows) == ["a.wav", "c_short.wav", "d_empty.wav", "e_corrupt.wav", "f_notes.txt", "g.wav", "sub/b.flac"]
    assert summary["files"] == 7 and summary["shards"] == 3 and summary["errors"] == 3
    assert "no samples" in rows["d_empty.wav"]["error"]
    assert rows["e_corrupt.wav"]["error"] and rows["f_notes.txt"]["error"] and rows["f_notes.txt"]["codes_0"] is None
    b = rows["sub/b.flac"]
    assert b["error"] is None and b["sampling_rate"] == 44100 and b["duration"] == int(0.7 * 44100) / 44100
    assert b["model"] == "synthetic:narrow"
    for name in ("a.wav", "c_short.wav", "g.wav", "sub/b.flac"):
        row = rows[name]
        samples = round(row["duration"] * 24000) if row["sampling_rate"] == 24000 else None
        lengths = [len(row[f"codes_{i}"]) for i in range(3)]
        assert lengths[0] * 4 == lengths[1] * 2 == lengths[2] >= 1
        if samples is not None:
            assert lengths == ds.code_lengths(samples, codec.config)
    assert pq.read_schema(tmp_path / "out" / "shard-00000.parquet").field("codes_2").type == pa.list_(pa.int16())


def test_codes_equal_encode_of_the_clip_and_ignore_batch_mates(codec, corpus, tmp_path):
    """Each clip's codes are codec.encode of the clip alone, at the default padding and without:
    batching (one clip per batch, all of one padded length together) never changes them."""
    one = ds.encode_dataset(corpus, tmp_path / "one", codec, pad_seconds=0, batch_seconds=1e-3, progress=False)
    many = ds.encode_dataset(corpus, tmp_path / "many", codec, pad_seconds=0, batch_seconds=1e4, progress=False)
    padded = ds.encode_dataset(corpus, tmp_path / "padded", codec, batch_seconds=1e4, progress=False)
    assert one["errors"] == many["errors"] == padded["errors"] == 3
    rows_one, rows_many, rows_padded = (rows_of(tmp_path / n) for n in ("one", "many", "padded"))
    assert rows_one == rows_many
    for name, row in rows_padded.items():
        if row["error"] is None:
            clip = ds.read_clip(ds.AudioInput(name, row["path"]), 24000)
            expected = codec.encode(torch.from_numpy(clip.audio).view(1, 1, -1))
            for level, want in enumerate(expected):
                assert rows_one[name][f"codes_{level}"] == row[f"codes_{level}"] == want[0].tolist(), (name, level)
    stereo, rate = soundfile.read(corpus / "sub" / "b.flac", dtype="float32")
    assert rate == 44100 and clip.audio.size == math.ceil(stereo.shape[0] * 24000 / 44100)  # mono, resampled


def test_encode_back_to_back_queues_each_shard_before_fetching_the_one_before(codec, corpus, monkeypatch):
    """encode_back_to_back (launched_one_ahead): shard k+1's batches are launched before shard k's
    codes are fetched, shards come back in order, each readable clip's codes are its own encode's."""
    clips = [ds.read_clip(item, 24000) for item in ds.list_inputs(corpus)]
    shards = [(0, clips[:3]), (1, clips[3:5]), (2, clips[5:])]
    events, launch = [], ds.batching.launch_batches
    monkeypatch.setattr(ds.batching, "launch_batches", lambda *a, **k: events.append("launch") or launch(*a, **k))
    done = []
    for index, shard, codes in ds.encode_back_to_back(codec, shards, pad_seconds=0.5, batch_seconds=1e4):
        events.append(f"fetched {index}")
        done.append(index)
        for clip, clip_codes in zip(shard, codes):
            assert (clip_codes is None) == (clip.error is not None)
            if clip_codes is not None:
                want = codec.encode(torch.from_numpy(clip.audio).view(1, 1, -1))
                assert [c.tolist() for c in clip_codes] == [w[0].tolist() for w in want], clip.input.id
    assert done == [0, 1, 2]
    assert events == ["launch", "launch", "fetched 0", "launch", "fetched 1", "fetched 2"]


def test_resume_after_a_crash_and_refuse_another_run(codec, corpus, tmp_path, monkeypatch):
    out = tmp_path / "out"
    whole = ds.encode_dataset(corpus, tmp_path / "whole", codec, files_per_shard=2, progress=False)
    real, calls = ds.launch_batches, []

    def crash_on_fourth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("power cut")
        return real(*args, **kwargs)

    monkeypatch.setattr(ds.local_engine, "launch_batches", crash_on_fourth)
    with pytest.raises(RuntimeError, match="power cut"):
        ds.encode_dataset(corpus, out, codec, files_per_shard=2, progress=False)
    # the shards whose clips were all launched before the failure are written (the writer thread
    # finishes them), complete; the others are not (their clips waited in batches not launched)
    before = sorted(p.name for p in out.glob("shard-*"))
    assert 1 <= len(before) < 4 and whole["shards"] == 4
    whole_rows, out_rows = rows_of(tmp_path / "whole"), rows_of(out)
    assert out_rows and all(whole_rows[name] == row for name, row in out_rows.items())
    calls.clear()
    resumed = ds.encode_dataset(corpus, out, codec, files_per_shard=2, progress=False)
    assert resumed["shards_skipped"] == len(before) and 1 <= len(calls) <= resumed["shards"] - len(before)
    assert rows_of(out) == whole_rows
    with pytest.raises(ValueError, match="different run.*files_per_shard"):
        ds.encode_dataset(corpus, out, codec, files_per_shard=3, progress=False)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the patched reader reaches the workers by fork")
def test_a_reader_process_that_dies_costs_only_its_file(codec, corpus, tmp_path, monkeypatch):
    """A crash inside the audio library kills a reader process: the file it was reading gets an
    error row, every other file its codes, in the same run (the worker inherits the patch by fork)."""
    real = ds.read_clip

    def crash_on_g(item, rate):
        if item.id == "g.wav":
            os._exit(11)  # what a segfault in libsndfile looks like to the pool
        return real(item, rate)

    monkeypatch.setattr(ds.readers, "read_clip", crash_on_g)
    summary = ds.encode_dataset(corpus, tmp_path / "out", codec, files_per_shard=4, loaders=2, progress=False)
    monkeypatch.undo()
    ds.encode_dataset(corpus, tmp_path / "whole", codec, files_per_shard=4, loaders=2, progress=False)
    rows, whole = rows_of(tmp_path / "out"), rows_of(tmp_path / "whole")
    assert "reader process died" in rows["g.wav"]["error"] and rows["g.wav"]["codes_0"] is None
    assert summary["errors"] == 4 and summary["files"] == 7
    assert {k: v for k, v in rows.items() if k != "g.wav"} == {k: v for k, v in whole.items() if k != "g.wav"}


def test_lists_and_manifests(codec, corpus, tmp_path):
    listing = tmp_path / "files.txt"
    listing.write_text(f"# two files\n{corpus / 'a.wav'}\n{corpus / 'g.wav'}\n")
    assert [i.path for i in ds.list_inputs(listing)] == [str(corpus / "a.wav"), str(corpus / "g.wav")]
    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text(json.dumps({"id": "x", "path": str(corpus / "a.wav")}) + "\n")
    table = pa.table({"id": ["y", "z"], "audio": [(corpus / "g.wav").read_bytes(), b"junk"]})
    pq.write_table(table, tmp_path / "m.parquet")
    ds.encode_dataset(jsonl, tmp_path / "from_jsonl", codec, progress=False)
    ds.encode_dataset(tmp_path / "m.parquet", tmp_path / "from_parquet", codec, progress=False)
    by_path, by_bytes = rows_of(tmp_path / "from_jsonl"), rows_of(tmp_path / "from_parquet")
    direct = rows_of(_encoded(codec, corpus, tmp_path))
    assert by_path["x"]["codes_2"] == direct["a.wav"]["codes_2"]
    assert by_bytes["y"]["codes_2"] == direct["g.wav"]["codes_2"] and by_bytes["y"]["path"] is None
    assert by_bytes["z"]["error"]
    with pytest.raises(ValueError, match="neither"):
        jsonl.write_text(json.dumps({"id": "q"}) + "\n")
        ds.list_inputs(jsonl)
    with pytest.raises(ValueError, match="more than once"):
        jsonl.write_text((json.dumps({"id": "q", "path": "a"}) + "\n") * 2)
        ds.list_inputs(jsonl)
    with pytest.raises(FileNotFoundError):
        ds.list_inputs(tmp_path / "missing.parquet.gz")


def _encoded(codec, corpus, tmp_path):
    out = tmp_path / "direct"
    if not out.exists():
        ds.encode_dataset(corpus, out, codec, progress=False)
    return out


def test_decode_back_to_audio(codec, corpus, tmp_path):
    listing = tmp_path / "some.txt"  # a short subset: decoding runs the kernels through the interpreter
    listing.write_text("".join(f"{corpus / name}\n" for name in ("sub/b.flac", "c_short.wav", "d_empty.wav")))
    ds.encode_dataset(listing, tmp_path / "codes", codec, progress=False)
    codes_dir, out = tmp_path / "codes", tmp_path / "audio"
    summary = ds.decode_dataset(codes_dir, out, codec, seed=3, progress=False)
    assert summary["written"] == 2 and summary["errors"] == 1
    errors = [json.loads(line)["id"] for line in (out / "_errors.jsonl").read_text().splitlines()]
    assert errors == [str(corpus / "d_empty.wav")]
    b_id = str(corpus / "sub" / "b.flac")
    row = rows_of(codes_dir)[b_id]
    expected = codec.decode([torch.tensor(row[f"codes_{i}"]).view(1, -1) for i in range(3)], seed=3)[0, 0]
    audio, rate = soundfile.read(out / (b_id.lstrip("/")[:-len(".flac")] + ".wav"), dtype="float32")  # inside out/
    length = round(row["duration"] * 24000)  # the source's length, not whole frames'
    assert length < expected.numel() and rate == 24000 and np.array_equal(audio, expected.numpy()[:length])
    assert ds.decode_dataset(codes_dir, out, codec, seed=3, progress=False)["skipped"] == 2  # resumable
    ds.decode_dataset(codes_dir, tmp_path / "pq", codec, seed=3, format="parquet", progress=False)
    back = {r["id"]: r for r in ds.read_shards(tmp_path / "pq")}
    assert np.array_equal(np.asarray(back[b_id]["audio"], np.float32), expected.numpy()[:length])
    with pytest.raises(ValueError, match="format"):
        ds.decode_dataset(codes_dir, out, codec, format="mp3")


def test_decode_names_outputs_after_their_sources_and_records_failed_rows(codec, tmp_path, monkeypatch):
    """a.wav -> a.wav, b.flac -> b.wav, but a.wav and a.flac both kept apart; a row whose decode
    fails is recorded and the others are written."""
    assert ds.decode._output_names(["x/a.wav", "b.flac", "c", "d.wav", "d.flac"], "wav") == {
        "x/a.wav": "x/a.wav", "b.flac": "b.wav", "c": "c.wav", "d.wav": "d.wav.wav", "d.flac": "d.flac.wav"}
    codes = [np.zeros(4 * 4 // s, np.int64) for s in (4, 2, 1)]  # 4 frames: 0.34 s of audio
    clips = [ds.Clip(ds.AudioInput(name, name), None, 0.3, 24000, None) for name in ("good.wav", "bad.wav")]
    table = ds.shard_table(clips, [codes, [c + 5000 for c in codes]], "in-memory", 3)  # 5000: past the codebook
    ds.shards.write_atomically(table, tmp_path / "s.parquet")
    summary = ds.decode_dataset(tmp_path / "s.parquet", tmp_path / "out", codec, progress=False)
    assert summary["written"] == 1 and summary["errors"] == 1
    error = json.loads((tmp_path / "out" / "_errors.jsonl").read_text())
    assert error["id"] == "bad.wav" and "decode failed" in error["error"] and "codebook" in error["error"]
    assert soundfile.info(str(tmp_path / "out" / "good.wav")).frames == round(0.3 * 24000)


def test_local_engine_reads_while_the_model_loads(corpus, tmp_path, monkeypatch):
    """Given a model's name (as the CLI runs it), the reader processes are forked and the first
    shards' reads submitted before the model loads; none of it when every shard is done. The
    checkpoint is looked up once (a hub lookup is a network round trip when online)."""
    import snac_fast.api
    import snac_fast.model.loading
    from snac_fast.datasets import readers
    from snac_fast.datasets.runs import CodecSource

    events = []
    submit, load, resolve = readers.Readers.submit, CodecSource.load, snac_fast.model.loading.resolve_checkpoint
    monkeypatch.setattr(readers.Readers, "submit", lambda self, items: events.append("read") or submit(self, items))
    monkeypatch.setattr(CodecSource, "load", lambda self: events.append("load") or load(self))
    for module in (snac_fast.model.loading, snac_fast.api):
        monkeypatch.setattr(module, "resolve_checkpoint", lambda *a, **k: events.append("resolve") or resolve(*a, **k))
    options = dict(model=str(make_checkpoint(tmp_path / "model", "snac_24khz", **NARROW)), device="cpu",
                   model_options={"accelerate_encoder": False, "fuse": False}, files_per_shard=3, loaders=1,
                   progress=False)
    summary = ds.encode_dataset(corpus, tmp_path / "out", **options)
    assert events[:4] == ["resolve", "read", "read", "load"] and summary["shards"] == len(summary["per_shard"]) == 3
    assert events.count("resolve") == 1
    events.clear()
    # done already: the lookup (for the run's record), no reading, no model
    assert ds.encode_dataset(corpus, tmp_path / "out", **options)["shards_skipped"] == 3 and events == ["resolve"]


def test_ray_engine_writes_the_same_shards(corpus, tmp_path, monkeypatch):
    """Ray Data on a local CPU cluster, two actors: each runs the local engine over its share of the
    shards (dealt out round-robin), one call each (never both shares queued on the first actor
    ready); the shards equal the local engine's."""
    from snac_fast.datasets import ray_engine

    calls = tmp_path / "calls"
    calls.mkdir()

    class Recorded(ray_engine._EncodeShare):  # defined here: Ray ships it to the actors by value
        def __call__(self, row):
            (calls / f"{os.getpid()}-{time.monotonic_ns()}").write_text(",".join(str(int(n)) for n in row["share"]))
            return super().__call__(row)

    monkeypatch.setattr(ray_engine, "_EncodeShare", Recorded)
    monkeypatch.setattr(ray_engine, "_actor_resources", lambda nodes, on_gpus: (2, 1.0, 0))  # two on CI's 2 CPUs
    model = str(make_checkpoint(tmp_path / "model", "snac_24khz", **NARROW))
    common = dict(model=model, device="cpu", model_options={"accelerate_encoder": False, "fuse": False},
                  files_per_shard=3, pad_seconds=0.5)
    local = ds.encode_dataset(corpus, tmp_path / "local", progress=False, **common)
    distributed = ds.encode_dataset(corpus, tmp_path / "ray", engine="ray", loaders=1, **common)
    def untimed(summary):  # per shard: everything but when it finished, in shard order
        shards = sorted(({k: v for k, v in d.items() if k != "finished_at"} for d in summary["per_shard"]),
                        key=lambda d: d["shard"])
        return {**{k: v for k, v in summary.items() if k not in ("wall_seconds", "per_shard")}, "per_shard": shards}

    assert untimed(distributed) == untimed(local) and len(local["per_shard"]) == 3
    made = sorted((p.name.split("-")[0], p.read_text()) for p in calls.iterdir())
    assert sorted(share for _, share in made) == ["0,2", "1"] and len({pid for pid, _ in made}) == 2
    assert sorted(p.name for p in (tmp_path / "ray").iterdir()) == sorted(p.name for p in (tmp_path / "local").iterdir())
    assert rows_of(tmp_path / "ray") == rows_of(tmp_path / "local")
    assert ds.encode_dataset(corpus, tmp_path / "ray", engine="ray", **common)["shards_skipped"] == 3  # resumable
    with pytest.raises(ValueError, match="not a codec"):
        ds.encode_dataset(corpus, tmp_path / "x", engine="ray", codec=object())


def test_ray_actors_one_per_gpu_each_with_its_nodes_share_of_cpus():
    from snac_fast.datasets.ray_engine import _actor_resources

    def node(cpus, gpus=0, alive=True):
        return {"Alive": alive, "Resources": {"CPU": cpus, **({"GPU": gpus} if gpus else {})}}

    assert _actor_resources([node(32, 2)], True) == (2, 16, 1)
    # the head node without GPUs reads nothing; the GPU node with fewer CPUs per GPU sets the share
    assert _actor_resources([node(4), node(64, 8), node(32, 2)], True) == (10, 8, 1)
    assert _actor_resources([node(32, 2), node(64, 4, alive=False)], True) == (2, 16, 1)
    assert _actor_resources([node(32, 2)], False) == (1, 32, 0)  # device="cpu": one actor per node
    assert _actor_resources([node(2), node(8)], True) == (2, 2, 0)


def test_ray_progress_counts_the_inputs_of_shards_written(tmp_path):
    from snac_fast.datasets.ray_engine import _files_written

    shards = [["a"] * 3, ["b"] * 2, ["c"] * 4]
    for name in (ds.shard_name(0), ds.shard_name(1), ds.shard_name(2) + ".partial"):
        (tmp_path / name).write_bytes(b"")
    assert _files_written(tmp_path, shards, [0, 2]) == 3  # shard 1 was done before the run; 2 is being written
    (tmp_path / ds.shard_name(2)).write_bytes(b"")
    assert _files_written(tmp_path, shards, [0, 2]) == 7


def test_reader_tasks_spool_their_audio_or_send_it_inline(corpus, tmp_path):
    """A reader task writes its clips into one spool file (lengths alone come back); where the spool
    cannot take it, the arrays come back themselves. Both give the clips read_clip gives."""
    items = [ds.AudioInput(n, str(corpus / n)) for n in ("a.wav", "d_empty.wav", "g.wav")]
    expected = [ds.read_clip(i, 24000) for i in items]
    readers = ds.readers.Readers.__new__(ds.readers.Readers)
    readers.dtype = "float32"
    for spool in (tmp_path, tmp_path / "missing"):
        path, meta = ds.readers._read_clips(items, 24000, "float32", str(spool))
        assert (path is None) == (spool != tmp_path)
        got = readers._unpack(path, meta)
        assert path is None or not os.path.exists(path)  # unlinked once mapped
        for (audio, duration, rate, error), want in zip(got, expected):
            assert (duration, rate, error) == (want.duration, want.sampling_rate, want.error)
            assert (audio is None and want.audio is None) or np.array_equal(audio, want.audio)


def test_batches_across_shards_fill_wait_and_drain():
    """BatchQueues: a length's clips leave as a batch once it is full (one shape per length), a
    part-full queue leaves after its oldest clip's shard waited ``hold`` shards, drain empties the
    rest; every readable clip in exactly one batch, rows zero-padded, unreadable clips never."""
    config = published_config("snac_24khz")
    codec = SimpleNamespace(config=config, dtype=torch.float32, device=torch.device("cpu"))
    second = config["sampling_rate"]
    rng = np.random.default_rng(1)

    def shard(index, seconds):  # a clip per entry: its duration in seconds, None for an unreadable file
        clips = [ds.Clip(ds.AudioInput(f"{index}-{k}"), None, None, None, "bad") if s is None else
                 ds.Clip(ds.AudioInput(f"{index}-{k}"), rng.standard_normal(round(s * second)).astype(np.float32),
                         s, second, None) for k, s in enumerate(seconds)]
        return ds.batching.PendingShard.of(index, clips)

    quantum = ds.padded_length(1, config, 1.0)  # 1.024 s: a second rounded to the padding unit
    queues = ds.BatchQueues(codec, pad_seconds=1.0, batch_seconds=6.2, hold=2)  # 3 rows of 2 quanta, 2 of 3
    shards = [shard(0, [1.5, 1.9, None, 2.5]), shard(1, [1.2]), shard(2, [0.4]), shard(3, [2.9, 2.1, 1.0])]
    samples = {(s.index, i): c.audio for s in shards for i, c in enumerate(s.clips)}
    assert shards[0].pending == 3
    left = [queues.add(shards[0]), queues.add(shards[1])]
    assert left[0] == [] and [b.rows for b in left[1]] == [[(shards[0], 0), (shards[0], 1), (shards[1], 0)]]
    [full] = left[1]
    assert full.audio.shape == (3, 1, 2 * quantum) and len(queues) == 1
    [late] = queues.add(shards[2])  # the 3 s queue's oldest clip (shard 0) has waited two shards
    assert late.rows == [(shards[0], 3)] and late.audio.shape == (1, 1, 3 * quantum)
    [full3] = queues.add(shards[3])  # 2.9 s and 2.1 s: a full 3 s batch; 1.0 s and 0.4 s wait
    assert full3.rows == [(shards[3], 0), (shards[3], 1)]
    rest = queues.drain()
    assert [b.rows for b in rest] == [[(shards[2], 0), (shards[3], 2)]] and len(queues) == 0
    batches = [full, late, full3, *rest]
    rows = [row for b in batches for row in b.rows]
    readable = [(s, i) for s in shards for i, c in enumerate(s.clips) if c.error is None]
    assert sorted((s.index, i) for s, i in rows) == sorted((s.index, i) for s, i in readable)
    for b in batches:
        for r, ((s, i), n) in enumerate(zip(b.rows, b.lengths)):
            assert n == samples[s.index, i].size and s.clips[i].audio is None  # batched: the shard lets go of it
            assert np.array_equal(b.audio[r, 0, :n].numpy(), samples[s.index, i]) and not b.audio[r, 0, n:].any()


def test_float16_batches_round_as_the_model_would():
    """Clips travel and batch in float16 for a float16 codec: numpy's rounding must be torch's."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(100_000).astype(np.float32) * 10.0 ** rng.integers(-9, 5, 100_000),
                        np.float32([6.1e-5, 5.96e-8, 2.98e-8, 65504.0, -0.0, 1.0 + 2.0 ** -11])]).astype(np.float32)
    codec = SimpleNamespace(config=published_config("snac_24khz"), dtype=torch.float16, device=torch.device("cpu"))
    clip = ds.Clip(ds.AudioInput("x"), x, x.size / 24000, 24000, None)
    [(rows, batch, lengths)] = ds.batch_audio(codec, [clip], pad_seconds=0, batch_seconds=1e9)  # the project's batching
    assert rows == [0] and lengths == [x.size] and batch.dtype == torch.float16
    assert torch.equal(batch[0, 0, :x.size], torch.from_numpy(x).to(torch.float16))  # as the model would round
    assert not batch[0, 0, x.size:].any()  # zero padding


def _read_threads_niceness() -> list[int]:
    threads = ds.readers._threads
    return [threads.submit(os.nice, 0).result() for _ in range(threads._max_workers)]


def test_readers_run_at_the_lowest_priority():
    # the launching thread must not queue behind a reader for a CPU (see _start_reader): neither the
    # reader process nor its reading threads
    lowest = min(19, os.nice(0) + 19)
    with ds.readers.Readers(1, 24000) as readers:
        assert readers.threads == 1 and readers.pool.submit(os.nice, 0).result() == lowest
    threads = ds.readers.THREADS_PER_READER
    with ds.readers.Readers(2 * threads, 24000) as readers:
        assert readers.processes == 2 and readers.threads == threads
        assert readers.pool.submit(_read_threads_niceness).result() == [lowest] * threads


@pytest.mark.parametrize("rate, new_rate", [(16000, 24000), (44100, 24000), (48000, 32000), (22050, 44100),
                                            (8000, 24000), (96000, 44100), (24000, 24000)])
def test_resample_mono_is_torchaudio_resample_of_the_padded_input(rate, new_rate):
    """resample_mono pads its input with zeros to a bucket of lengths (torch's CPU conv sets up per
    length), resamples with torchaudio and cuts the output to torchaudio's own length for the input
    (its float32 length, one short of the exact ceiling at 1,000,098 samples from 44.1 to 24 kHz):
    bit for bit torchaudio's resample of the padded input, and within float32 rounding of its
    resample of the input itself (the conv may sum in another order for another length); 2-D too."""
    import torchaudio.functional as AF

    from snac_fast.codes import RESAMPLE_BUCKET, RESAMPLE_BUCKETS_UP_TO, resample_mono

    rng = torch.Generator().manual_seed(rate + new_rate)
    lengths = [1, 2, 3, RESAMPLE_BUCKET - 1, RESAMPLE_BUCKET, RESAMPLE_BUCKET + 1, 1_000_098]
    if rate == 44100:  # around the limit of the buckets (long inputs: one pair of rates is enough)
        lengths += [RESAMPLE_BUCKETS_UP_TO - 1, RESAMPLE_BUCKETS_UP_TO + 7]
    lengths += torch.randint(4, 200_000, (12,), generator=rng).tolist()
    for n in lengths:
        x = torch.randn(n, generator=rng)
        alone = AF.resample(x, orig_freq=rate, new_freq=new_rate)
        got = resample_mono(x, rate, new_rate)
        if n >= RESAMPLE_BUCKETS_UP_TO:  # long inputs are not padded: torchaudio's own samples
            assert torch.equal(got, alone), n
            continue
        padded = AF.resample(torch.nn.functional.pad(x, (0, -n % RESAMPLE_BUCKET)), orig_freq=rate, new_freq=new_rate)
        assert got.shape == alone.shape and torch.equal(got, padded[:alone.numel()]), n
        assert (got - alone).abs().max() <= 1e-6 * alone.abs().max(), n
    x = torch.randn(2, 54_321, generator=rng)
    alone = AF.resample(x, orig_freq=rate, new_freq=new_rate)
    assert resample_mono(x, rate, new_rate).shape == alone.shape
    torch.testing.assert_close(resample_mono(x, rate, new_rate), alone, rtol=0, atol=1e-6)


def test_read_mono_mixes_down_and_refuses_non_finite_samples(tmp_path):
    from snac_fast.codes import read_mono

    rng = np.random.default_rng(3)
    mono, stereo = rng.uniform(-1, 1, 301).astype(np.float32), rng.uniform(-1, 1, (257, 2)).astype(np.float32)
    soundfile.write(tmp_path / "mono.wav", mono, 16000, subtype="FLOAT")
    soundfile.write(tmp_path / "stereo.wav", stereo, 16000, subtype="FLOAT")
    got, rate = read_mono(tmp_path / "mono.wav")
    assert rate == 16000 and torch.equal(got, torch.from_numpy(mono))
    assert torch.equal(read_mono(tmp_path / "stereo.wav")[0], torch.from_numpy(stereo).mean(dim=1))
    bad = {"nan": (mono, 17, np.nan), "inf": (mono, 300, np.inf), "opposite_infs": (stereo, 5, None)}
    for name, (samples, at, value) in bad.items():
        samples = samples.copy()
        if value is None:  # +inf and -inf in one frame: their mean is NaN
            samples[at] = (np.inf, -np.inf)
        else:
            samples[at] = value
        soundfile.write(tmp_path / f"{name}.wav", samples, 16000, subtype="FLOAT")
        with pytest.raises(ValueError, match="non-finite"):
            read_mono(tmp_path / f"{name}.wav")
        clip = ds.read_clip(ds.AudioInput(name, str(tmp_path / f"{name}.wav")), 24000)
        assert clip.audio is None and "non-finite" in clip.error


@pytest.mark.gpu
def test_gpu_engine_codes_equal_each_clips_own_encode(cuda, corpus, tmp_path):
    # the GPU path: pinned batches, codes back through asynchronous copies and one event per shard,
    # several shards in flight; every clip's codes must be its own encode's (pad_seconds=0)
    fast = FastSNAC(synthetic_model("snac_24khz"), device=cuda, dtype=torch.float16, source="synthetic:snac_24khz")
    ds.encode_dataset(corpus, tmp_path / "out", fast, files_per_shard=2, pad_seconds=0, progress=False)
    rows = rows_of(tmp_path / "out")
    assert sum(r["error"] is None for r in rows.values()) == 4
    for name, row in rows.items():
        if row["error"] is None:
            clip = ds.read_clip(ds.AudioInput(name, row["path"]), 24000)
            audio = torch.from_numpy(clip.audio).view(1, 1, -1).to(cuda, torch.float16)
            for level, want in enumerate(fast.encode(audio)):
                assert row[f"codes_{level}"] == want[0].tolist(), (name, level)


@pytest.mark.gpu
def test_gpu_engine_replays_graphs_for_full_batches(cuda, tmp_path, monkeypatch):
    """Batches of one length fill across shards and replay a CUDA graph from their second on (one
    memory pool): the shards equal those of an engine that launches every batch eagerly."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for k in range(18):  # six clips each of 1, 2 and 3 padded seconds (1.024 s quanta at 24 kHz)
        seconds = (0.5 + 0.05 * k, 1.3 + 0.05 * k, 2.3 + 0.05 * k)[k % 3]
        soundfile.write(folder / f"{k:02d}.wav", speech_like(seconds, 24000, k), 24000)
    made = []

    def spy(codec):
        made.append(ds.batching.corpus_graphs(codec))
        return made[-1]

    monkeypatch.setattr(ds.local_engine, "corpus_graphs", spy)  # where the engine looks it up
    run = dict(files_per_shard=3, batch_seconds=6.2, progress=False)  # 6, 3 and 2 rows a batch
    graphed = FastSNAC(synthetic_model("snac_24khz"), device=cuda, dtype=torch.float16, source="synthetic:snac_24khz")
    eager = FastSNAC(synthetic_model("snac_24khz"), device=cuda, dtype=torch.float16, source="synthetic:snac_24khz",
                     cuda_graphs=False)
    ds.encode_dataset(folder, tmp_path / "graphed", graphed, **run)
    ds.encode_dataset(folder, tmp_path / "eager", eager, **run)
    assert made[0] is not None and made[0].captures == 2 and made[1] is None  # the 2- and 3-quanta shapes
    graphed_rows, eager_rows = rows_of(tmp_path / "graphed"), rows_of(tmp_path / "eager")
    assert len(graphed_rows) == 18 and all(r["error"] is None for r in graphed_rows.values())
    assert graphed_rows == eager_rows
