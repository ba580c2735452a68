"""Encode benchmark (GPU): snac-fast's encode against upstream eager and under torch.compile, then
corpus throughput of ``snac_fast.datasets.encode_dataset`` (local engine) against the same codec's
own batched encode of the same audio.

    python scripts/bench_encode.py --model snac_24khz --out benchmarks/encode_24khz_h100

Per workload every mode is built afresh (the compile peer: reduce-overhead, fp16 autocast,
``dynamic=False``, compiled for that one shape) and the modes are timed in interleaved rounds over
rotated inputs: per call = wall clock with a synchronize, GPU = CUDA events around the call. The
corpus: speech-like clips of 2-12 s written as 16 kHz WAV files (200 distinct clips, the other
files hard links to them; every file is read, resampled, batched by the pipeline); "own batched
encode" encodes the same clips already resampled, nothing read or written: in each shard's own batches
(eager, as ``encode_back_to_back``) and in the engine's batches across shards (CUDA graphs); the
pipeline is compared with the faster. Each corpus run also
records the GPUs' busy fraction (nvidia-smi) and the host's busy cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    MachineLoad,
    environment,
    markdown_table,
    timed_call,
    write_results,
)

from snac_fast import (
    FastSNAC,  # noqa: E402
    datasets,  # noqa: E402
)
from snac_fast.configs import published_config  # noqa: E402
from snac_fast.encoding import padding_unit  # noqa: E402
from snac_fast.model.surgery import fold_weight_norm, to_device_dtype  # noqa: E402
from snac_fast.model.synthetic import speech_like, synthetic_model  # noqa: E402

CUDA = torch.device("cuda")
N_SETS = 3
EAGER, COMPILE, FOLDED, FAST = ("upstream eager fp32", "compile r-o fp16 autocast", "compile r-o fp16 folded",
                                "snac-fast fp16")
FAST_ROWS = "snac-fast fp16, rows of own lengths"


def upstream_encode(name: str, folded_half: bool = False):
    model = synthetic_model(name)
    if folded_half:  # weight norm folded, the model cast to fp16 (the 32/44 kHz attention kept fp32)
        fold_weight_norm(model)
    to_device_dtype(model, CUDA, torch.float16 if folded_half else torch.float32)
    return model.encode


def compiled_encode(name: str, folded_half: bool = False):
    encode = torch.compile(upstream_encode(name, folded_half), mode="reduce-overhead", dynamic=False)

    def run(audio):  # outside inference mode: dynamo's guards on upstream's numpy hop_length fail inside it
        with torch.inference_mode(False), torch.no_grad(), torch.autocast("cuda", dtype=torch.float16,
                                                                          enabled=not folded_half):
            return encode(audio.half() if folded_half else audio)

    return run


def fast_encode(name: str):
    codec = FastSNAC(synthetic_model(name), device=CUDA, dtype=torch.float16)
    return lambda audio: codec.encode(audio)


def fast_rows_encode(name: str):
    """The same encode told each row's own length (``lengths``: every row shorter than the batch,
    as in a padded dataset batch), so the cost of clearing the rows' tails shows against FAST."""
    codec = FastSNAC(synthetic_model(name), device=CUDA, dtype=torch.float16)
    unit = padding_unit(codec.config)

    def encode(audio):  # rows 1-4 padding units (and a sample) short of the batch
        batch, samples = audio.shape[0], audio.shape[-1]
        return codec.encode(audio, lengths=[max(1, samples - (i % 4 + 1) * unit - 1) for i in range(batch)])
    return encode


MODES = {EAGER: upstream_encode, COMPILE: compiled_encode, FOLDED: lambda name: compiled_encode(name, True),
         FAST: fast_encode, FAST_ROWS: fast_rows_encode}
BEST_PEER = (COMPILE, FOLDED)


def bench_workload(name: str, seconds: float, batch: int, rounds: int) -> dict:
    rate = published_config(name)["sampling_rate"]
    rng = np.random.default_rng(0)
    sets = [torch.from_numpy(np.stack([speech_like(seconds, rate, int(rng.integers(1 << 30)))
                                       for _ in range(batch)])[:, None]).to(CUDA) for _ in range(N_SETS)]
    torch._dynamo.reset()  # each compile sees this one shape
    built, first = {}, {}
    for mode, build in MODES.items():
        t0 = time.perf_counter()
        try:
            fn = build(name)
            with torch.inference_mode():
                for audio in sets * 2:
                    fn(audio)
            torch.cuda.synchronize()
        except Exception as error:  # reported, and the other modes still count
            print(f"{mode} failed at {seconds:g} s B={batch}: {type(error).__name__}: {error}"[:500], flush=True)
            continue
        built[mode], first[mode] = fn, time.perf_counter() - t0
    walls = {m: [] for m in built}
    gpus = {m: [] for m in built}
    for r in range(rounds):
        for mode in (list(built) if r % 2 == 0 else list(reversed(built))):
            for i in range(6):
                wall, gpu = timed_call(built[mode], sets[(r + i) % N_SETS])
                walls[mode].append(wall)
                gpus[mode].append(gpu)
    out = {m: {"median_ms": statistics.median(walls[m]), "gpu_median_ms": statistics.median(gpus[m]),
               "build_and_warmup_s": first[m]} for m in built}
    if EAGER in built and FAST in built:  # fp16 fast codes against upstream fp32 codes, per level
        with torch.inference_mode():
            ours, theirs = built[FAST](sets[0]), built[EAGER](sets[0])
        out[FAST]["code_agreement"] = [(a == b).float().mean().item() for a, b in zip(ours, theirs)]
    for m, v in out.items():
        print(f"{m:<28} {seconds:g} s B={batch:<3} {v['median_ms']:9.3f} ms  GPU {v['gpu_median_ms']:9.3f} ms", flush=True)
    return out


def write_corpus(folder: Path, files: int) -> None:
    """``files`` speech-like 16 kHz WAV files of 2-12 s (200 distinct clips, repeated)."""
    rng = np.random.default_rng(1)
    clips = [speech_like(rng.uniform(2, 12), 16000, int(rng.integers(1 << 30))) for _ in range(min(files, 200))]
    folder.mkdir()
    for n in range(files):
        path = folder / f"{n:06d}.wav"
        if n < len(clips):
            soundfile.write(path, clips[n], 16000)
        else:  # a repeat: a hard link (a large corpus written in seconds; every file is still read)
            os.link(folder / f"{n % len(clips):06d}.wav", path)


def steady_rate(shards: list[dict]) -> float | None:
    """Audio hours per minute between the first and the last shard finished (start-up excluded)."""
    ends = sorted((d["finished_at"], d["audio_seconds"]) for d in shards)
    if len(ends) < 2 or ends[-1][0] <= ends[0][0]:
        return None
    return sum(a for _, a in ends[1:]) / 3600 / (ends[-1][0] - ends[0][0]) * 60


def own_encode_queued(codec, shards: list, batch_seconds: float) -> float:
    """Seconds the codec's own encode takes for ``shards``' clips in the local engine's batches (built
    beforehand, not timed): launched as the engine launches them, each round's codes fetched after
    the next round is queued, through a fresh graph cache (its captures timed, as in a run)."""
    queues = datasets.BatchQueues(codec, 1.0, batch_seconds)
    rounds = [queues.add(datasets.batching.PendingShard.of(n, clips)) for n, clips in shards]
    rounds[-1] += queues.drain()
    graphs = datasets.batching.corpus_graphs(codec)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _, launched in datasets.batching.launched_one_ahead(codec, enumerate(rounds), graphs):
        for _ in datasets.batching.launched_codes(codec, launched):
            pass
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_corpus(name: str, files: int, batch_seconds: float, ray_gpus: list[int], local_runs: int = 2) -> dict:
    """Hours of audio per minute: the local dataset engine vs the codec's own encode of the same
    clips (resampled already) in the same shards and batches; then the Ray engine on 1..n GPUs."""
    codec = FastSNAC(synthetic_model(name), device=CUDA, dtype=torch.float16, source=f"synthetic:{name}")
    per_shard = 256  # encode_dataset's default
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "corpus"
        write_corpus(folder, files)
        run = {"files_per_shard": per_shard, "batch_seconds": batch_seconds, "progress": False}
        print(f"corpus of {files} files written", flush=True)
        warm = datasets.encode_dataset(folder, Path(tmp) / "warm", codec, **run)  # compiles, caches: not timed
        # timed runs (two by default), the faster kept, as for the own encode below
        timed = []
        for k in range(local_runs):
            with MachineLoad() as load:
                timed.append(datasets.encode_dataset(folder, Path(tmp) / f"out{k}", codec, **run))
            timed[-1]["load"] = load.summary()
        summary = min(timed, key=lambda r: r["wall_seconds"])
        items = datasets.list_inputs(folder)
        with datasets.readers.Readers(16, codec.sampling_rate, datasets.batching.batch_dtype(codec)) as readers:
            clips = readers.collect(items, readers.submit(items))
        shards = list(enumerate(clips[k:k + per_shard] for k in range(0, len(clips), per_shard)))
        own = []  # (seconds, machine load) per run
        for _ in range(2):  # the same shards and batches, queued back to back, no reading or writing
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with MachineLoad() as sampled:
                for _ in datasets.encode_back_to_back(codec, shards, 1.0, batch_seconds):
                    pass
                torch.cuda.synchronize()
            own.append((time.perf_counter() - t0, sampled.summary()))
        queued = []  # the same clips in the local engine's batches (across shards, CUDA graphs), no reading or writing
        for _ in range(2):
            with MachineLoad() as sampled:
                seconds = own_encode_queued(codec, shards, batch_seconds)
            queued.append((seconds, sampled.summary()))
        own_s, own_load = min(own, key=lambda r: r[0])  # the faster run, and its load
        queued_s, queued_load = min(queued, key=lambda r: r[0])
        hours = summary["audio_seconds"] / 3600
        result = {"files": files, "audio_hours": hours, "pipeline_s": summary["wall_seconds"],
                  "own_encode_s": own_s, "own_queued_s": queued_s, "warm_run_s": warm["wall_seconds"],
                  "pipeline_hours_per_minute": hours / summary["wall_seconds"] * 60,
                  "own_shard_batches_hours_per_minute": hours / own_s * 60,
                  "own_queued_hours_per_minute": hours / queued_s * 60,
                  "own_hours_per_minute": hours / min(own_s, queued_s) * 60,  # the faster reference
                  "pipeline_steady_hours_per_minute": steady_rate(summary["per_shard"]),
                  "pipeline_load": summary["load"], "own_load": own_load if own_s <= queued_s else queued_load}
        result["pipeline_vs_own"] = result["pipeline_hours_per_minute"] / result["own_hours_per_minute"]
        print("corpus:", {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}, flush=True)
        del codec, clips, shards
        torch.cuda.empty_cache()
        result["ray"] = {}
        if ray_gpus:
            import ray
        for k, gpus in enumerate(ray_gpus):
            ray.init(num_gpus=gpus, log_to_driver=False)  # encode_dataset joins it: the actors see `gpus` GPUs
            label = f"{gpus} GPU" + ("s" if gpus > 1 else "") + (f" ({ray_gpus[:k].count(gpus) + 1})" if gpus in ray_gpus[:k] else "")
            try:
                with MachineLoad() as load:
                    ray_run = datasets.encode_dataset(folder, Path(tmp) / f"ray{k}", engine="ray",
                                                      model=f"synthetic:{name}", dtype="float16", **run)
            finally:
                ray.shutdown()
            wall = ray_run["wall_seconds"]
            result["ray"][label] = {"gpus": gpus, "wall_s": wall, "hours_per_minute": hours / wall * 60,
                                    "steady_hours_per_minute": steady_rate(ray_run["per_shard"]),
                                    "shards_equal_local": same_shards(Path(tmp) / f"ray{k}", Path(tmp) / "out0"),
                                    "load": load.summary()}
            print(f"ray {label}:", result["ray"][label], flush=True)
    return result


def _load_text(load: dict) -> str:
    busy = load["gpu_busy"].get(torch.cuda.current_device())
    cores = load["host_cores_busy"]
    return (f"{busy:.2f}" if busy is not None else "-") + " / " + (f"{cores:.1f}" if cores is not None else "-")


def same_shards(a: Path, b: Path) -> bool:
    import pyarrow.parquet as pq

    names = sorted(p.name for p in a.glob("shard-*.parquet"))
    return names == sorted(p.name for p in b.glob("shard-*.parquet")) and all(
        pq.read_table(a / n).equals(pq.read_table(b / n)) for n in names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="snac_24khz")
    ap.add_argument("--no-corpus", action="store_true", help="skip the dataset throughput run")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/encode"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--no-workloads", action="store_true", help="only the dataset throughput run")
    ap.add_argument("--files", type=int, default=2000, help="corpus files (2-12 s each)")
    ap.add_argument("--batch-seconds", type=float, default=300.0)
    ap.add_argument("--ray-gpus", default="", help="also run the Ray engine on these GPU counts, in order, e.g. 1,2")
    ap.add_argument("--local-runs", type=int, default=2, help="timed runs of the local engine, the faster kept")
    args = ap.parse_args()
    loads = [] if args.no_workloads else [(10.0, 1), (10.0, 32), (60.0, 1)]
    results = {f"{s:g} s B={b}": bench_workload(args.model, s, b, args.rounds) for s, b in loads}
    ray_gpus = [int(g) for g in args.ray_gpus.split(",") if g]
    corpus = None if args.no_corpus else bench_corpus(args.model, args.files, args.batch_seconds, ray_gpus,
                                                      args.local_runs)
    env = environment()
    rows = []
    for label, by_mode in results.items():
        peers = [by_mode[p]["median_ms"] for p in BEST_PEER if p in by_mode]
        for mode, r in by_mode.items():
            agree = " / ".join(f"{100 * a:.2f}" for a in r.get("code_agreement", []))
            rows.append([label, mode, f"{r['median_ms']:.3f}", f"{r['gpu_median_ms']:.3f}",
                         f"{min(peers) / r['median_ms']:.2f}x" if peers else "-", agree or "-",
                         f"{r['build_and_warmup_s']:.1f}"])
    command = " ".join(["python scripts/bench_encode.py"] + sys.argv[1:])
    md = (f"# Encode benchmark: {args.model}\n\n{env['device']}, {env['date']}, torch {env['torch']}. "
          f"`{command}`. "
          + ("Modes built afresh per workload (compile: reduce-overhead, fp16 autocast, `dynamic=False`), timed in "
             "interleaved rounds; per call = wall clock with a synchronize, GPU = CUDA events; medians. "
             "'vs best peer': the faster compile peer's per-call time over this mode's. Code agreement: snac-fast "
             "fp16 codes equal to upstream eager fp32 codes on speech-like input, % per level." if rows else "")
          + "\n\n"
          + (markdown_table(["workload", "mode", "per call ms", "GPU ms", "vs best peer", "code agreement %",
                             "build + warm-up s"], rows) if rows else ""))
    if corpus is not None:
        md += (f"\nCorpus, local engine, one GPU: {corpus['files']} speech-like WAV files (16 kHz, 2-12 s, "
               f"{corpus['audio_hours']:.2f} h), 256 files per shard: {corpus['pipeline_hours_per_minute']:.1f} h of "
               f"audio per minute ({corpus['pipeline_s']:.1f} s, the fastest of {args.local_runs} run(s); "
               f"{corpus['pipeline_steady_hours_per_minute']:.1f} h/min from the first shard written to the last); "
               f"the codec's own batched encode of the same clips, in each shard's batches (eager) "
               f"{corpus['own_shard_batches_hours_per_minute']:.1f} h/min, in the engine's batches across "
               f"shards (CUDA graphs) {corpus['own_queued_hours_per_minute']:.1f} h/min; pipeline / the faster = "
               f"{corpus['pipeline_vs_own']:.2f}. GPU busy (nvidia-smi) / host cores busy: pipeline "
               f"{_load_text(corpus['pipeline_load'])}, own encode {_load_text(corpus['own_load'])}.\n")
        if corpus["ray"]:
            local = corpus["pipeline_steady_hours_per_minute"]

            def ratio(a, b):
                return f"{a / b:.2f}" if a and b else "-"

            def one_gpu(r):
                return next((o["steady_hours_per_minute"] for o in corpus["ray"].values() if o["gpus"] == 1), None)

            def busy(r):
                used = sorted(r["load"]["gpu_busy"].items())[:r["gpus"]]
                return " / ".join(f"{b:.2f}" for _, b in used) or "-"
            md += ("\nRay engine (a local Ray cluster on this machine; wall = the whole run, Ray start-up and actor "
                   "model loads included; steady = audio per minute between the first and the last shard "
                   "finished; per GPU vs local: steady / GPUs / the local engine's steady rate; GPU busy: "
                   "nvidia-smi's utilization over the whole run, start-up included, per GPU; host cores: busy "
                   "cores over the whole run):\n\n" + markdown_table(
                       ["run", "wall s", "h/min (wall)", "h/min (steady)", "steady vs 1 GPU",
                        "per GPU vs local (steady)", "GPU busy", "host cores", "shards equal local"],
                       [[label, f"{r['wall_s']:.1f}",
                         f"{r['hours_per_minute']:.1f}",
                         f"{r['steady_hours_per_minute']:.1f}" if r["steady_hours_per_minute"] else "-",
                         ratio(r["steady_hours_per_minute"], one_gpu(r)),
                         ratio(r["steady_hours_per_minute"] and r["steady_hours_per_minute"] / r["gpus"], local),
                         busy(r), f"{r['load']['host_cores_busy']:.1f}" if r["load"]["host_cores_busy"] else "-",
                         r["shards_equal_local"]] for label, r in corpus["ray"].items()]))
    write_results(args.out.parent, args.out.name, {"environment": env, "model": args.model, "encode": results,
                                                   "corpus": corpus}, md)
    print(md)


if __name__ == "__main__":
    main()
