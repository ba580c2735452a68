"""Corpora in the forms users have them, rows in the form fine-tuning wants: WebDataset tar shards
read in place, carried columns, Orpheus ids (with the notebook's duplicate-frame removal) and
training rows from a tokenizer, every sample accounted for."""

import io
import json
import tarfile

import numpy as np
import pytest
import soundfile
import torch
from helpers import NARROW, cli

from snac_fast import FastSNAC
from snac_fast import datasets as ds
from snac_fast.datasets.rows import RowFormat, remove_duplicate_frames
from snac_fast.model.synthetic import speech_like, synthetic_model
from snac_fast.orpheus import ORPHEUS


@pytest.fixture(scope="module")
def codec():
    return FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu", source="synthetic:narrow",
                    accelerate_encoder=False, fuse=False)


def audio_bytes(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format=fmt, subtype=subtype)
    return out.getvalue()


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Two Emilia-like WebDataset shards: mp3, flac, opus and wav members with JSON metadata, a
    silent clip (its frames repeat), a sample without audio and one whose JSON is broken."""
    root = tmp_path_factory.mktemp("wds")
    samples = {
        "spk1/utt_a": ("mp3", audio_bytes(speech_like(1.2, 24000, 1), 24000, "MP3")),
        "spk1/utt_b": ("flac", audio_bytes(speech_like(0.9, 44100, 2), 44100, "FLAC")),
        "spk2/utt_c": ("opus", audio_bytes(speech_like(0.8, 48000, 3), 48000, "OGG", "OPUS")),
        "spk2/utt_silent": ("wav", audio_bytes(np.zeros(24000, np.float32), 24000, "WAV")),
    }
    with tarfile.open(root / "shard-000.tar", "w") as tar:
        for key in ("spk1/utt_a", "spk1/utt_b"):
            ext, data = samples[key]
            add(tar, f"{key}.{ext}", data)
            add(tar, f"{key}.json", json.dumps({"text": f"words of {key}", "speaker": key.split("/")[0],
                                                "language": "en", "dnsmos": 3.2}).encode())
        add(tar, "spk1/utt_noaudio.json", json.dumps({"text": "no audio here"}).encode())
    with tarfile.open(root / "shard-001.tar", "w") as tar:
        for key in ("spk2/utt_c", "spk2/utt_silent"):
            ext, data = samples[key]
            add(tar, f"{key}.{ext}", data)
            add(tar, f"{key}.json", json.dumps({"text": f"words of {key}", "speaker": "spk2"}).encode())
        add(tar, "spk2/utt_badjson.wav", samples["spk2/utt_silent"][1])
        add(tar, "spk2/utt_badjson.json", b"{not json")
    return root, samples


def notebook_dedupe(vals):
    """Unsloth's Orpheus notebook's remove_duplicate_frames, as it stands (the reference)."""
    result = vals[:7]
    for i in range(7, len(vals), 7):
        if vals[i] != result[-7]:
            result.extend(vals[i:i + 7])
    return result


def test_webdataset_shards_to_orpheus_rows(codec, shards, tmp_path):
    root, samples = shards
    rows_format = RowFormat(columns=("text", "speaker", "dnsmos"), format="orpheus")
    summary = ds.encode_dataset(str(root / "shard-*.tar"), tmp_path / "out", codec, files_per_shard=2,
                                progress=False, rows=rows_format)
    rows = {r["id"]: r for r in ds.read_shards(tmp_path / "out")}
    assert sorted(rows) == ["spk1/utt_a", "spk1/utt_b", "spk1/utt_noaudio", "spk2/utt_badjson", "spk2/utt_c",
                            "spk2/utt_silent"]  # every sample, the broken ones as error rows
    assert summary["errors"] == 2
    assert "no audio member" in rows["spk1/utt_noaudio"]["error"] and rows["spk1/utt_noaudio"]["codes_0"] is None
    assert "does not parse" in rows["spk2/utt_badjson"]["error"]
    assert rows["spk1/utt_a"]["text"] == "words of spk1/utt_a" and rows["spk1/utt_a"]["dnsmos"] == "3.2"
    assert rows["spk2/utt_c"]["speaker"] == "spk2" and rows["spk2/utt_c"]["dnsmos"] is None
    assert rows["spk1/utt_b"]["sampling_rate"] == 44100 and rows["spk2/utt_c"]["sampling_rate"] == 48000
    for key, (ext, data) in samples.items():  # each row's codes: codec.encode of that clip alone
        clip = ds.read_clip(ds.AudioInput(key, data=data), codec.sampling_rate)
        with torch.inference_mode():
            want = codec.encode(torch.from_numpy(clip.audio).view(1, 1, -1))
        row = rows[key]
        assert [row[f"codes_{i}"] for i in range(3)] == [c[0].tolist() for c in want], key
        assert row["orpheus_ids"] == ORPHEUS.codes_to_ids(want).tolist()
    # read with the datasets library as the shards are (the fine-tuning side's loader)
    datasets = pytest.importorskip("datasets")
    loaded = datasets.load_dataset("parquet", data_files=str(tmp_path / "out" / "*.parquet"), split="train")
    assert sorted(loaded["id"]) == sorted(rows) and "orpheus_ids" in loaded.column_names


def test_duplicate_frames_removed_as_the_notebook_does(codec, shards, tmp_path):
    root, _ = shards
    ds.encode_dataset(str(root / "shard-001.tar"), tmp_path / "plain", codec, progress=False,
                      rows=RowFormat(format="orpheus"))
    ds.encode_dataset(str(root / "shard-001.tar"), tmp_path / "dedup", codec, progress=False,
                      rows=RowFormat(format="orpheus", remove_duplicate_frames=True))
    plain = {r["id"]: r for r in ds.read_shards(tmp_path / "plain")}
    dedup = {r["id"]: r for r in ds.read_shards(tmp_path / "dedup")}
    silent = plain["spk2/utt_silent"]["orpheus_ids"]
    assert len(dedup["spk2/utt_silent"]["orpheus_ids"]) < len(silent)  # the silent clip's frames repeat
    for key in plain:
        if plain[key]["orpheus_ids"] is not None:
            assert dedup[key]["orpheus_ids"] == notebook_dedupe(plain[key]["orpheus_ids"]), key
    rng = np.random.default_rng(0)
    for _ in range(200):  # the rule itself, against the notebook's, on runs with repeats
        ids = rng.integers(0, 3, (int(rng.integers(1, 12)), 7)).reshape(-1).tolist()
        assert remove_duplicate_frames(ids) == notebook_dedupe(ids)


def make_tokenizer(folder):
    """A small fast tokenizer saved as transformers saves one: words, and a start of text it adds."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<|begin_of_text|>", "words", "of", "spk1/utt_a", "spk1/utt_b", "spk2/utt_c", "spk2/utt_silent",
             "spk1", "spk2", ":"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", unk_token="<unk>").save_pretrained(folder)
    return str(folder)


def test_training_rows_from_a_tokenizer(codec, shards, tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    root, _ = shards
    name = make_tokenizer(tmp_path / "tokenizer")
    ds.encode_dataset(str(root / "shard-000.tar"), tmp_path / "out", codec, progress=False,
                      rows=RowFormat(format="orpheus", tokenizer=name, speaker_column="speaker"))
    rows = {r["id"]: r for r in ds.read_shards(tmp_path / "out")}
    tokenizer = AutoTokenizer.from_pretrained(name)
    row = rows["spk1/utt_a"]
    text_ids = tokenizer.encode("spk1: words of spk1/utt_a", add_special_tokens=True)
    assert text_ids[0] == 1  # its start of text
    assert row["input_ids"] == [128259, *text_ids, 128009, 128260, 128261, 128257, *row["orpheus_ids"], 128258, 128262]
    assert row["labels"] == row["input_ids"] and row["attention_mask"] == [1] * len(row["input_ids"])
    assert rows["spk1/utt_noaudio"]["input_ids"] is None and rows["spk1/utt_noaudio"]["error"]


def test_row_format_refuses_what_it_cannot_build(codec, shards, tmp_path):
    root, _ = shards
    with pytest.raises(ValueError, match="format='orpheus'"):
        ds.encode_dataset(str(root / "shard-000.tar"), tmp_path / "a", codec, rows=RowFormat(remove_duplicate_frames=True))
    codec32 = FastSNAC(synthetic_model("snac_32khz", **NARROW), device="cpu", accelerate_encoder=False, fuse=False)
    with pytest.raises(ValueError, match="3-level"):
        ds.encode_dataset(str(root / "shard-000.tar"), tmp_path / "b", codec32, rows=RowFormat(format="orpheus"))
    with pytest.raises(ValueError, match="glob must name WebDataset"):
        ds.encode_dataset(str(root / "*.json"), tmp_path / "c", codec)  # matches nothing
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.heavy
def test_ray_engine_writes_the_same_orpheus_rows_from_tar_shards(shards, tmp_path, monkeypatch):
    """The Ray engine (a local CPU cluster, two actors) over WebDataset shards with carried columns
    and Orpheus ids: the same shards as the local engine."""
    from snac_fast.datasets import ray_engine
    from snac_fast.model.synthetic import make_checkpoint

    root, _ = shards
    monkeypatch.setattr(ray_engine, "_actor_resources", lambda nodes, on_gpus: (2, 1.0, 0))  # two on CI's 2 CPUs
    model = str(make_checkpoint(tmp_path / "model", "snac_24khz", **NARROW))
    common = dict(model=model, device="cpu", model_options={"accelerate_encoder": False, "fuse": False},
                  files_per_shard=2, rows=RowFormat(columns=("text", "speaker"), format="orpheus",
                                                    remove_duplicate_frames=True))
    ds.encode_dataset(str(root / "shard-*.tar"), tmp_path / "local", progress=False, **common)
    ds.encode_dataset(str(root / "shard-*.tar"), tmp_path / "ray", engine="ray", loaders=1, **common)
    local, distributed = list(ds.read_shards(tmp_path / "local")), list(ds.read_shards(tmp_path / "ray"))
    assert len(local) == 6 and distributed == local


def test_hugging_face_datasets_in_memory_and_saved_to_disk(codec, tmp_path):
    """A datasets.Dataset with an Audio column (bytes, and paths, at any rate), given as the object
    and as a save_to_disk folder: the same rows, the text carried, codes of each clip alone."""
    datasets = pytest.importorskip("datasets")
    clips = [speech_like(1.0, 24000, 5), speech_like(0.6, 16000, 6), speech_like(0.8, 44100, 7)]
    rates = [24000, 16000, 44100]
    paths = []
    for k, (clip, rate) in enumerate(zip(clips, rates)):
        paths.append(str(tmp_path / f"clip{k}.flac"))
        soundfile.write(paths[-1], clip, rate)
    audio = [{"bytes": open(paths[0], "rb").read(), "path": None}, {"bytes": None, "path": paths[1]},
             {"bytes": open(paths[2], "rb").read(), "path": "clip2.flac"}]
    import pyarrow as pa

    # built as Arrow (as a Parquet or hub dataset arrives), then typed: datasets' own encoder needs torchcodec
    table = pa.table({"audio": pa.array(audio, pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                      "text": ["one", "two", "three"], "id": ["u0", "u1", "u2"]})
    dataset = datasets.Dataset(table).cast(datasets.Features({"audio": datasets.Audio(), "text": datasets.Value("string"),
                                                              "id": datasets.Value("string")}))
    dataset.save_to_disk(str(tmp_path / "saved"))
    rows = RowFormat(columns=("text",), format="orpheus")
    ds.encode_dataset(dataset, tmp_path / "a", codec, progress=False, rows=rows)
    ds.encode_dataset(str(tmp_path / "saved"), tmp_path / "b", codec, progress=False, rows=rows)
    a, b = list(ds.read_shards(tmp_path / "a")), list(ds.read_shards(tmp_path / "b"))
    unplaced = [[{k: v for k, v in r.items() if k != "path"} for r in rows] for rows in (a, b)]
    assert unplaced[0] == unplaced[1]  # save_to_disk embeds a path's file: only the path differs
    assert [r["id"] for r in a] == ["u0", "u1", "u2"] and [r["text"] for r in a] == ["one", "two", "three"]
    assert [r["sampling_rate"] for r in a] == rates and all(r["error"] is None for r in a)
    for row, path in zip(a, paths):
        clip = ds.read_clip(ds.AudioInput(row["id"], path), codec.sampling_rate)
        with torch.inference_mode():
            want = codec.encode(torch.from_numpy(clip.audio).view(1, 1, -1))
        assert row["codes_2"] == want[2][0].tolist() and row["orpheus_ids"] == ORPHEUS.codes_to_ids(want).tolist()
    with pytest.raises(ValueError, match="no column 'speaker'"):
        ds.encode_dataset(dataset, tmp_path / "c", codec, rows=RowFormat(columns=("speaker",)))


def test_encode_dataset_command_with_orpheus_rows(shards, tmp_path):
    from snac_fast.model.synthetic import make_checkpoint

    root, _ = shards
    model = str(make_checkpoint(tmp_path / "model", "snac_24khz", **NARROW))
    done = cli("encode-dataset", root / "shard-*.tar", tmp_path / "out", "--model", model, "--device", "cpu",
               "--format", "orpheus", "--columns", "text,speaker", "--remove-duplicate-frames")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "6 files in 1 shards" in done.stdout
    rows = {r["id"]: r for r in ds.read_shards(tmp_path / "out")}
    assert rows["spk1/utt_a"]["speaker"] == "spk1" and len(rows["spk1/utt_a"]["orpheus_ids"]) % 7 == 0
    refused = cli("encode-dataset", root / "shard-000.tar", tmp_path / "x", "--remove-duplicate-frames")
    assert refused.returncode == 2 and "add --format orpheus" in refused.stderr
