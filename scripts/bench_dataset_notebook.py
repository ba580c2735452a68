"""Training rows from one corpus, side by side on one GPU: the pipeline Orpheus fine-tuners copy
(Unsloth's Orpheus notebook) against ``snac-fast encode-dataset --format orpheus
--remove-duplicate-frames``, from the same clips as a Hugging Face Parquet (wav bytes, as the hub
stores audio datasets) and as WebDataset tar shards of mp3 + json (as VyvoTTS reads Emilia).

The corpus is Emilia-like: speech-like clips of 3-15 s, half at 24 kHz and half at 44.1 kHz, a text
each (``--distinct`` different clips, repeated under distinct ids). The notebook's pipeline as it
stands: ``load_dataset("parquet")``, a per-row ``dataset.map`` that builds a new resampler for each
clip, encodes it alone (B=1) with upstream SNAC in float32 on the GPU, reads every code with
``.item()`` into the 7 interleaved slots (offset 128266 + slot * 4096), then a second map that drops
the frames whose first id repeats the last kept frame's. Its clips are decoded in the map with
soundfile (datasets 3's Audio decoder: 4 and later need torchcodec and a system FFmpeg).

Reported: hours of audio a minute (wall clock, the model loaded beforehand), the GPU's busy share
and the host's busy cores (nvidia-smi, /proc/stat), the readers' cost per file by format (one
process), and how many rows' ids equal the notebook's (snac-fast runs fp16; the notebook float32).

    python scripts/bench_dataset_notebook.py --files 3000 --out benchmarks --stem dataset_orpheus_24khz_h200
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import soundfile
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import MachineLoad, environment, markdown_table, write_results  # noqa: E402

OFFSET, CODEBOOK = 128266, 4096  # Orpheus's first audio id and the codes a slot
TAR_SAMPLES = 500  # samples a WebDataset shard


def speech_like(rng: np.random.Generator, rate: int, seconds: float) -> np.ndarray:
    """A voiced, syllable-rate-modulated signal with a wandering pitch, and some breath noise."""
    t = np.arange(int(rate * seconds)) / rate
    pitch = 110 + 40 * np.sin(2 * np.pi * rng.uniform(0.2, 0.6) * t + rng.uniform(0, 6))
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = np.clip(np.sin(2 * np.pi * rng.uniform(3, 5) * t + rng.uniform(0, 6)), 0, None) ** 0.5
    audio = 0.25 * envelope * voiced + 0.01 * rng.standard_normal(t.size)
    return (audio / max(1e-6, np.abs(audio).max()) * 0.8).astype(np.float32)


def encoded_clip(index: int) -> tuple[int, bytes, bytes, float, str]:
    """Clip ``index``: (rate, wav bytes, mp3 bytes, seconds, text)."""
    import av

    rng = np.random.default_rng(index)
    rate = 24000 if index % 2 == 0 else 44100
    seconds = float(rng.uniform(3, 15))
    audio = speech_like(rng, rate, seconds)
    wav = io.BytesIO()
    soundfile.write(wav, audio, rate, format="WAV", subtype="PCM_16")
    mp3 = io.BytesIO()
    with av.open(mp3, "w", format="mp3") as container:
        stream = container.add_stream("libmp3lame", rate=rate, layout="mono")
        stream.bit_rate = 64000
        frame = av.AudioFrame.from_ndarray(audio[None], format="flt", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    words = " ".join(f"word{int(w)}" for w in rng.integers(0, 1000, int(seconds * 2.5)))
    return rate, wav.getvalue(), mp3.getvalue(), seconds, words


def write_corpus(folder: Path, files: int, distinct: int) -> dict:
    """The corpus as a datasets Parquet and as mp3 tar shards: their paths and the audio hours."""
    from datasets import Audio, Dataset

    with ProcessPoolExecutor(max(1, min(16, os.cpu_count() or 1))) as pool:
        clips = list(pool.map(encoded_clip, range(min(files, distinct)), chunksize=8))
    ids = [f"clip{n:06d}" for n in range(files)]
    picked = [clips[n % len(clips)] for n in range(files)]
    parquet = folder / "train-00000-of-00001.parquet"
    table = Dataset.from_dict({"id": ids, "text": [c[4] for c in picked],
                               "audio": [{"bytes": c[1], "path": f"{i}.wav"} for i, c in zip(ids, picked)]})
    table.cast_column("audio", Audio()).to_parquet(str(parquet))
    tars = folder / "tars"
    tars.mkdir()
    for shard in range(0, files, TAR_SAMPLES):
        with tarfile.open(tars / f"shard-{shard // TAR_SAMPLES:05d}.tar", "w") as tar:
            for i, c in zip(ids[shard:shard + TAR_SAMPLES], picked[shard:shard + TAR_SAMPLES]):
                for name, data in ((f"{i}.mp3", c[2]), (f"{i}.json", json.dumps({"text": c[4]}).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return {"parquet": parquet, "tars": str(tars / "shard-*.tar"), "hours": sum(c[3] for c in picked) / 3600,
            "rates": sorted({c[0] for c in picked})}


def notebook_rows(parquet: Path, device: str, model_name: str) -> tuple[dict, float]:
    """The notebook's pipeline: {id: ids after duplicate removal}, and its wall seconds (model loaded before)."""
    import torchaudio
    from datasets import Audio, load_dataset

    from snac_fast.model.loading import build_upstream, resolve_checkpoint

    model = build_upstream(resolve_checkpoint(model_name)).to(device).eval()  # upstream SNAC, float32
    start = time.perf_counter()
    dataset = load_dataset("parquet", data_files=str(parquet), split="train", keep_in_memory=True)
    dataset = dataset.cast_column("audio", Audio(decode=False))

    def tokenise_audio(example):
        samples, rate = soundfile.read(io.BytesIO(example["audio"]["bytes"]), dtype="float32")
        waveform = torch.from_numpy(samples).unsqueeze(0)
        waveform = torchaudio.transforms.Resample(orig_freq=rate, new_freq=24000)(waveform)  # a new one per clip
        with torch.inference_mode():
            codes = model.encode(waveform.unsqueeze(0).to(device))
        ids = []
        for i in range(codes[0].shape[1]):  # every code read to the host on its own, as the notebook does
            ids += [codes[0][0][i].item() + OFFSET, codes[1][0][2 * i].item() + OFFSET + CODEBOOK,
                    codes[2][0][4 * i].item() + OFFSET + 2 * CODEBOOK, codes[2][0][4 * i + 1].item() + OFFSET + 3 * CODEBOOK,
                    codes[1][0][2 * i + 1].item() + OFFSET + 4 * CODEBOOK, codes[2][0][4 * i + 2].item() + OFFSET + 5 * CODEBOOK,
                    codes[2][0][4 * i + 3].item() + OFFSET + 6 * CODEBOOK]
        example["codes_list"] = ids
        return example

    def drop_repeated_frames(example):
        ids, kept = example["codes_list"], example["codes_list"][:7]
        for at in range(7, len(ids), 7):
            if ids[at] != kept[-7]:
                kept += ids[at:at + 7]
        example["codes_list"] = kept
        return example

    dataset = dataset.map(tokenise_audio, remove_columns=["audio"], keep_in_memory=True)
    dataset = dataset.map(drop_repeated_frames, keep_in_memory=True)
    rows = dict(zip(dataset["id"], dataset["codes_list"]))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return rows, time.perf_counter() - start


def snac_fast_rows(source, out: Path, codec) -> tuple[dict, dict]:
    """``encode-dataset --format orpheus --remove-duplicate-frames --columns text``: ({id: ids}, summary)."""
    import pyarrow.parquet as pq

    from snac_fast.datasets import encode_dataset
    from snac_fast.datasets.rows import RowFormat

    rows = RowFormat(columns=("text",), format="orpheus", remove_duplicate_frames=True)
    with MachineLoad() as load:
        summary = encode_dataset(source, out, codec, rows=rows, progress=False)
    summary["load"] = load.summary()
    ids = {}
    for shard in sorted(out.glob("shard-*.parquet")):
        table = pq.read_table(shard, columns=["id", "orpheus_ids"]).to_pydict()
        ids.update(zip(table["id"], table["orpheus_ids"]))
    return ids, summary


def reader_cost(corpus: dict, files: int) -> dict:
    """ms a file and per audio second for one process reading (decode + resample to 24 kHz) wav and mp3."""
    from snac_fast.datasets.inputs import list_inputs, read_clip

    out = {}
    for name, source in (("wav (Parquet bytes)", corpus["parquet"]), ("mp3 (tar member)", corpus["tars"])):
        items = list_inputs(source)[:files]
        start = time.perf_counter()
        seconds = sum(read_clip(item, 24000).duration or 0 for item in items)
        wall = time.perf_counter() - start
        out[name] = {"ms_a_file": 1e3 * wall / len(items), "ms_an_audio_second": 1e3 * wall / seconds}
    return out


def agreement(reference: dict, got: dict) -> float:
    same = sum(1 for k, v in reference.items() if k in got and list(got[k]) == list(v))
    return same / max(1, len(reference))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--distinct", type=int, default=400, help="different clips (the rest repeat them)")
    parser.add_argument("--model", default="synthetic:snac_24khz")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--runs", type=int, default=2, help="runs of each side, in turn; the faster kept")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--stem", default="dataset_orpheus_24khz")
    cli = parser.parse_args()

    from snac_fast import FastSNAC

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        corpus = write_corpus(folder, cli.files, cli.distinct)
        print(f"corpus: {cli.files} files, {corpus['hours']:.2f} h, written in {time.perf_counter() - t0:.0f} s", flush=True)
        codec = FastSNAC.from_pretrained(cli.model, device=cli.device)
        snac_fast_rows(corpus["parquet"], folder / "warm", codec)  # compiles and caches: not timed
        runs: dict[str, list] = {"notebook": [], "parquet": [], "tars": []}
        results: dict[str, dict] = {}
        for r in range(cli.runs):
            with MachineLoad() as load:
                notebook, wall = notebook_rows(corpus["parquet"], cli.device, cli.model)
            runs["notebook"].append({"wall_seconds": wall, "load": load.summary()})
            results["notebook"] = notebook
            for name in ("parquet", "tars"):
                ids, summary = snac_fast_rows(corpus[name], folder / f"{name}{r}", codec)
                runs[name].append(summary)
                results[name] = ids
            print(f"round {r}: notebook {wall:.1f} s, parquet {runs['parquet'][-1]['wall_seconds']:.1f} s, "
                  f"tars {runs['tars'][-1]['wall_seconds']:.1f} s", flush=True)
        readers = reader_cost(corpus, 200)

    hours = corpus["hours"]
    best = {name: min(rs, key=lambda x: x["wall_seconds"]) for name, rs in runs.items()}
    rate = {name: hours / b["wall_seconds"] * 60 for name, b in best.items()}
    report = {"environment": environment(), "files": cli.files, "distinct": cli.distinct, "audio_hours": hours,
              "source_rates": corpus["rates"], "runs": runs,
              "hours_per_minute": rate, "vs_notebook": {n: rate[n] / rate["notebook"] for n in ("parquet", "tars")},
              "tars_vs_parquet": rate["tars"] / rate["parquet"],
              "rows_equal_notebook": {n: agreement(results["notebook"], results[n]) for n in ("parquet", "tars")},
              "errors": {n: best[n].get("errors", 0) for n in ("parquet", "tars")}, "readers": readers}
    rows = []
    for name, label in (("notebook", "notebook pipeline (upstream float32, B=1)"),
                        ("parquet", "encode-dataset, datasets Parquet (wav)"), ("tars", "encode-dataset, mp3 tar shards")):
        load = best[name]["load"]
        busy = next(iter(load.get("gpu_busy", {}).values()), None)
        rows.append([label, f"{best[name]['wall_seconds']:.1f}", f"{rate[name]:.1f}",
                     f"{rate[name] / rate['notebook']:.1f}x", "-" if busy is None else f"{busy:.2f}",
                     "-" if load.get("host_cores_busy") is None else f"{load['host_cores_busy']:.1f}",
                     "" if name == "notebook" else f"{report['rows_equal_notebook'][name]:.3f}"])
    table = markdown_table(["pipeline", "wall s", "audio h a minute", "vs notebook", "GPU busy", "host cores busy",
                            "rows equal to the notebook's"], rows)
    reader_rows = [[k, f"{v['ms_a_file']:.2f}", f"{v['ms_an_audio_second']:.3f}"] for k, v in readers.items()]
    markdown = (f"# Orpheus training rows from a corpus ({report['environment']['device']}, {report['environment']['date']})\n\n"
                f"{cli.files} clips ({cli.distinct} distinct), {hours:.2f} h of audio at {corpus['rates']} Hz, "
                f"3-15 s each; {cli.model}; the faster of {cli.runs} runs each. mp3 tars at "
                f"{report['tars_vs_parquet']:.2f} of the Parquet rate.\n\n{table}\n"
                f"Readers, one process (decode + resample to 24 kHz):\n\n"
                f"{markdown_table(['format', 'ms a file', 'ms an audio second'], reader_rows)}\n"
                f"`python scripts/bench_dataset_notebook.py --files {cli.files} --distinct {cli.distinct} --runs {cli.runs}`\n")
    print(markdown)
    if cli.out:
        write_results(cli.out, cli.stem, report, markdown)


if __name__ == "__main__":
    main()
