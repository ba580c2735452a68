"""Streaming TTS decode on the GPU: the sliding-window glue servers write vs snac-fast's stream engine.

One run, one GPU, the same codes for every mode, at 1, 16, 64 and 256 concurrent streams. A step
gives every stream one new coarse frame. Modes:

- window_eager_fp32: upstream SNAC (as loaded, weight norm intact), the 4-frame window of each stream
  batched, keeping samples [2048, 4096) (one frame) as Orpheus-style servers do;
- window_compile_fp16: the same under torch.compile(mode="reduce-overhead", dynamic=False), fp16
  autocast, compiled afresh for each batch size (static shapes);
- window_compile_fp16_folded: the same compile of upstream with weight norm folded and the model
  cast to fp16 (the second peer a careful user could build); ratios are against the faster peer;
- window_snac_fast: snac-fast's decode (CUDA graphs, fp16) on the same windows;
- engine: snac-fast's exact stream engine (CUDA graphs, fp16), one frame per stream per step, fed
  per-stream pushes (``engine.advance``, what the batcher does);
- engine_batched: the same engine fed one tensor per level for all streams (``engine.step``).

Per-call latency: host clock around the call plus a sync, median of interleaved rounds (modes
alternate inside each round). GPU time: CUDA events around the call. Then a simulated load through
the asyncio batcher: every stream pushes one frame every ``--frame-interval-ms`` (default: half a
frame's duration, an LM running at 2x real time), for ``--load-seconds``; push-to-audio latency
p50/p99 and time to first audio. Fidelity: fp32 and fp16 streams against whole decodes.

    python scripts/bench_stream.py --model snac_24khz --out benchmarks
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import GcProbe, environment, markdown_table, write_results  # noqa: E402

from snac_fast import FastSNAC  # noqa: E402
from snac_fast.fidelity import true_float32  # noqa: E402
from snac_fast.metrics import snr_db  # noqa: E402
from snac_fast.model.surgery import fold_weight_norm, to_device_dtype  # noqa: E402
from snac_fast.model.synthetic import synthetic_model  # noqa: E402
from snac_fast.serve import AsyncStreamBatcher  # noqa: E402

WINDOW = 4  # frames per window, as Orpheus-style servers decode


def random_codes(config, frames, batch, gen, device="cpu"):
    s = config["vq_strides"]
    return [torch.randint(0, config["codebook_size"], (batch, frames * s[0] // x), generator=gen).to(device) for x in s]


def window_of(codes, strides, frame):
    """Each stream's 4-frame window ending at ``frame`` (inclusive)."""
    return [c[:, (frame - WINDOW + 1) * strides[0] // s:(frame + 1) * strides[0] // s] for c, s in zip(codes, strides)]


def timed(fn):
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, start.elapsed_time(end)


def stream_fidelity(codec_fp16, codec_fp32, config, frames):
    gen = torch.Generator().manual_seed(123)
    codes = random_codes(config, frames, 1, gen)
    strides = config["vq_strides"]
    out = {}
    with torch.no_grad():
        ref32 = codec_fp32.decode(codes, seed=5).float()[0, 0]
        ref16 = codec_fp16.decode(codes, seed=5).float()[0, 0]
    for name, codec in (("fp32", codec_fp32), ("fp16", codec_fp16)):
        stream, pieces, f = codec.stream(seed=5), [], 0
        group = stream.engine.frames_per_group
        sizes = [1, 2, 3, 1]
        i = 0
        while f < frames:
            k = min(frames - f, sizes[i % len(sizes)] * group)
            pieces.append(stream.push([c[:, f * strides[0] // s:(f + k) * strides[0] // s] for c, s in zip(codes, strides)]))
            f, i = f + k, i + 1
        pieces.append(stream.flush())
        y = torch.cat(pieces).float()
        out[f"stream_{name}_vs_offline_fp32_db"] = snr_db(ref32, y)
    out["offline_fp16_vs_offline_fp32_db"] = snr_db(ref32, ref16)
    return out


class LoadProbe(GcProbe):
    """What can stall a push under the simulated load: the garbage collector's pauses, each engine
    call the batcher makes (``step_rows`` and ``advance``, timed in its thread), graphs captured while
    serving."""

    def __init__(self, engine):
        super().__init__()
        self.engine, self.calls = engine, []
        self.graphs_before = len(engine.steps.graphs)

    def __enter__(self):
        for name in ("advance", "step_rows"):
            setattr(self.engine, name, self._timed(getattr(self.engine, name)))
        return super().__enter__()

    def _timed(self, call):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.calls.append((time.perf_counter() - t0) * 1e3)
        return timed

    def __exit__(self, *exc):
        super().__exit__(*exc)
        del self.engine.advance, self.engine.step_rows

    def summary(self) -> dict:
        gc_summary = super().summary()
        return {"gc_pauses": gc_summary["gc_pauses"], "gc_max_pause_ms": gc_summary["gc_max_pause_ms"],
                "gc_gen2_collections": gc_summary["gc_full"], "gc_gen2_max_pause_ms": gc_summary["gc_full_max_ms"],
                "engine_call_max_ms": max(self.calls, default=0.0),
                "engine_call_p99_ms": statistics.quantiles(self.calls, n=100)[98] if len(self.calls) > 2 else 0.0,
                "graphs_captured_during_load": len(self.engine.steps.graphs) - self.graphs_before}


async def simulated_load(engine, config, streams, interval_ms, seconds, gen):
    with LoadProbe(engine) as probe:
        result = await _simulated_load(engine, config, streams, interval_ms, seconds, gen)
    return {**result, **probe.summary()}


async def _simulated_load(engine, config, streams, interval_ms, seconds, gen):
    batcher = AsyncStreamBatcher(engine, max_batch=max(streams, 1), max_wait_ms=2.0)
    strides = config["vq_strides"]
    latencies, first_audio = [], []
    frames_total = int(seconds * 1000 / interval_ms) + engine.prefill_frames

    async def one(i):
        sid = batcher.open(seed=i)
        codes = random_codes(config, frames_total, 1, gen)
        start = time.perf_counter()
        await asyncio.sleep((i % 16) * interval_ms / 16e3)  # streams out of phase
        t_first = None
        for f in range(frames_total):
            t0 = time.perf_counter()
            audio = await batcher.push(sid, [c[:, f * strides[0] // s:(f + 1) * strides[0] // s] for c, s in zip(codes, strides)])
            done = time.perf_counter()
            if audio.numel():
                latencies.append((done - t0) * 1e3)
                if t_first is None:
                    t_first = (done - start) * 1e3
            await asyncio.sleep(max(0.0, interval_ms / 1e3 - (time.perf_counter() - t0)))
        first_audio.append(t_first)
        await batcher.flush(sid)

    await asyncio.gather(*(one(i) for i in range(streams)))
    batcher.close()
    q = statistics.quantiles(latencies, n=100)
    return {"p50_ms": statistics.median(latencies), "p99_ms": q[98], "pushes": len(latencies),
            "time_to_first_audio_ms": statistics.median(first_audio), "batches": batcher.batches}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="snac_24khz")
    parser.add_argument("--streams", default="1,16,64,256")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--load-seconds", type=float, default=3.0)
    parser.add_argument("--frame-interval-ms", type=float, default=None)
    parser.add_argument("--skip", default="", help="comma-separated modes to leave out")
    parser.add_argument("--out", default=None)
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.freeze() before each simulated load: objects made so far leave the collector's scans")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    device = torch.device("cuda")
    name = args.model
    codec = FastSNAC.from_pretrained(f"synthetic:{name}", device=device)
    config = codec.config
    strides = config["vq_strides"]
    rate = config["sampling_rate"]
    upstream = synthetic_model(name).to(device).eval()
    folded = synthetic_model(name)
    fold_weight_norm(folded)
    to_device_dtype(folded, device, torch.float16)
    sizes = [int(s) for s in args.streams.split(",")]
    engine = codec.stream_engine(max(sizes))
    spf = engine.samples_per_frame
    frame_ms = 1000.0 * spf / rate
    interval = args.frame_interval_ms or frame_ms / 2
    group = engine.frames_per_group
    gen = torch.Generator().manual_seed(0)
    results = {"environment": environment(), "model": name, "samples_per_frame": spf, "frame_ms": frame_ms,
               "lookahead_samples": engine.lookahead_samples, "lookahead_ms": engine.lookahead_ms,
               "prefill_frames": engine.prefill_frames, "state_bytes_per_stream": engine.state_bytes_per_stream,
               "frame_interval_ms": interval, "rows": []}
    keep = slice(spf, 2 * spf)  # one frame of the window: samples 2048:4096 at 24 kHz
    codec32 = FastSNAC.from_pretrained(f"synthetic:{name}", device=device, dtype=torch.float32)
    with true_float32():
        results["fidelity"] = stream_fidelity(codec, codec32, config, 12 * group + engine.prefill_frames)
    del codec32
    print(results["fidelity"], flush=True)
    results["gc_freeze"] = args.gc_freeze
    t0 = time.perf_counter()
    results["engine_warmup_graphs"] = engine.warmup()
    results["engine_warmup_s"] = time.perf_counter() - t0
    print(f"engine warm-up: {results['engine_warmup_graphs']} graphs in {results['engine_warmup_s']:.1f} s", flush=True)
    for S in sizes:
        torch._dynamo.reset()
        total = engine.prefill_frames + (2 * args.rounds + 30) * group + WINDOW
        codes = random_codes(config, total, S, gen, device)
        codes_cpu = [c.cpu() for c in codes]
        compiled = torch.compile(upstream.decode, mode="reduce-overhead", dynamic=False)
        compiled_folded = torch.compile(folded.decode, mode="reduce-overhead", dynamic=False)
        slots = [engine.open(seed=i) for i in range(S)]
        prefill = {s: [c[i, :engine.prefill_frames * strides[0] // x] for c, x in zip(codes_cpu, strides)] for i, s in enumerate(slots)}
        engine.advance(prefill)
        position = engine.prefill_frames
        # every step's codes are cut before the timing: a server holds them already
        per_stream = [{s: [c[i, f * strides[0] // x:(f + group) * strides[0] // x] for c, x in zip(codes_cpu, strides)]
                       for i, s in enumerate(slots)} for f in range(position, total - group + 1, group)]
        batched = [[c[:, f * strides[0] // x:(f + group) * strides[0] // x] for c, x in zip(codes_cpu, strides)]
                   for f in range(position, total - group + 1, group)]
        step_index = 0

        def engine_step():  # per-stream pushes (what the batcher hands the engine)
            nonlocal step_index
            engine.advance(per_stream[step_index])
            step_index += 1

        def engine_batched():  # one tensor per level for all streams (a batched LM's output)
            nonlocal step_index
            engine.step(slots, batched[step_index])
            step_index += 1

        modes = {
            "window_eager_fp32": lambda w: upstream.decode(w)[..., keep],
            "window_compile_fp16": lambda w: _autocast(compiled, w)[..., keep],
            "window_compile_fp16_folded": lambda w: compiled_folded(w)[..., keep],
            "window_snac_fast": lambda w: codec.decode(w)[..., keep],
        }
        modes = {k: v for k, v in modes.items() if k not in skip}
        with torch.inference_mode():
            for fn in modes.values():  # warm-up: compile, capture
                for f in range(WINDOW - 1, WINDOW + 2):
                    fn(window_of(codes, strides, f))
        engine_step()
        engine_batched()
        engines = {"engine": engine_step, "engine_batched": engine_batched}
        samples = {m: ([], []) for m in [*modes, *engines]}
        for r in range(args.rounds):
            f = WINDOW - 1 + r
            with torch.inference_mode():
                for m, fn in modes.items():
                    w = window_of(codes, strides, f)
                    wall, gpu = timed(lambda: fn(w))
                    samples[m][0].append(wall)
                    samples[m][1].append(gpu)
            for m, fn in engines.items():
                wall, gpu = timed(fn)
                samples[m][0].append(wall)
                samples[m][1].append(gpu)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        steps = min(20, len(batched) - step_index)
        for _ in range(steps):  # back to back, one sync at the end: a busy server's throughput
            engine_batched()
        torch.cuda.synchronize()
        pipelined = (time.perf_counter() - t0) * 1e3 / steps
        graph = engine.steps.graphs.get(("step", engine.steps.bucket(S), group))
        replay = statistics.median(timed(graph.graph.replay)[1] for _ in range(args.rounds)) if graph else None
        for s in slots:
            engine.close(s)
        row = {"streams": S, "audio_ms_per_step": S * group * frame_ms, "engine_graph_replay_ms": replay,
               "engine_pipelined_ms_per_step": pipelined,
               "realtime_streams_pipelined": int(S * group * frame_ms / pipelined)}
        for m, (wall, gpu) in samples.items():
            wall_ms, gpu_ms = statistics.median(wall), statistics.median(gpu)
            row[m] = {"call_ms": wall_ms, "call_p99_ms": statistics.quantiles(wall, n=100)[98] if len(wall) > 2 else wall_ms,
                      "gpu_ms": gpu_ms, "gpu_ms_per_audio_s": gpu_ms / (S * group * frame_ms / 1000),
                      "realtime_streams": int(S * group * frame_ms / wall_ms)}
        if "load" not in skip:
            if args.gc_freeze:
                gc.collect()
                gc.freeze()
            row["load"] = asyncio.run(simulated_load(engine, config, S, interval, args.load_seconds, gen))
            gc.unfreeze()
        results["rows"].append(row)
        print(S, {m: round(row[m]["call_ms"], 3) for m in samples}, row.get("load"), flush=True)
        compiled = compiled_folded = None  # free their graphs before the next batch size
        gc.collect()
        results["peak_memory_mib"] = torch.cuda.max_memory_allocated() / 2**20
        if args.out:  # after every row: a run cut short keeps what it measured
            write_results(Path(args.out), f"stream_{name.split('_')[-1]}_{_device_tag()}", results, _markdown(results))
    print(_markdown(results))


def _autocast(fn, w):
    with torch.autocast("cuda", dtype=torch.float16):
        return fn(w)


def _faster_peer(row: dict) -> str:
    """The compile peer with the lower per-call latency in this row."""
    peers = [m for m in ("window_compile_fp16", "window_compile_fp16_folded") if m in row]
    return min(peers, key=lambda m: row[m]["call_ms"]) if peers else "window_compile_fp16"


def _device_tag() -> str:
    name = torch.cuda.get_device_name(0).lower()
    return "h100" if "h100" in name else "h200" if "h200" in name else "gpu"


def _markdown(r: dict) -> str:
    env = r["environment"]
    lines = [f"# Streaming decode, {r['model']}: {env['device']}, {env['date']}, torch {env['torch']}, triton {env['triton']}\n",
             f"One step = one new frame ({r['frame_ms']:.1f} ms of audio) per stream. Exact stream lookahead: "
             f"{r['lookahead_samples']} samples ({r['lookahead_ms']:.1f} ms); first audio after {r['prefill_frames']} frames; "
             f"state {r['state_bytes_per_stream'] / 1024:.1f} KiB per stream. Call = host clock with sync (median of "
             "interleaved rounds); GPU = CUDA events around the call.\n"]
    modes = ["window_eager_fp32", "window_compile_fp16", "window_compile_fp16_folded", "window_snac_fast", "engine",
             "engine_batched"]
    header = ["streams"] + [f"{m} call ms" for m in modes] + ["engine_batched vs faster compile", "vs eager",
                                                               "engine_batched / window_snac_fast"]
    rows = []
    for row in r["rows"]:
        cells = [row["streams"]] + [f"{row[m]['call_ms']:.3f}" if m in row else "-" for m in modes]
        e = row["engine_batched"]["call_ms"]
        peer = _faster_peer(row)
        cells += [f"{row[m]['call_ms'] / e:.2f}x" if m in row else "-" for m in (peer, "window_eager_fp32")]
        cells.append(f"{e / row['window_snac_fast']['call_ms']:.2f}" if "window_snac_fast" in row else "-")
        rows.append(cells)
    lines.append(markdown_table(header, rows))
    lines.append("\nGPU time: CUDA events around each call (for the windows, the GPU work; for the engine, the graph "
                 "replay alone, without the host's share). Pipelined: batched steps back to back, one sync at the end "
                 "(a busy server's rate). Real-time streams one GPU sustains = audio per step / time per step.\n")
    rows = []
    for row in r["rows"]:
        audio_s = row["audio_ms_per_step"] / 1000
        cells = [row["streams"]] + [f"{row[m]['gpu_ms']:.3f}" if m in row else "-" for m in modes[:4]]
        replay, peer = row["engine_graph_replay_ms"], _faster_peer(row)
        cells += [f"{replay:.3f}" if replay else "-", f"{row['engine_pipelined_ms_per_step']:.3f}",
                  f"{row[peer]['gpu_ms'] / audio_s:.2f}" if peer in row else "-",
                  f"{replay / audio_s:.2f}" if replay else "-",
                  row[peer]["realtime_streams"] if peer in row else "-",
                  row["realtime_streams_pipelined"]]
        rows.append(cells)
    lines.append(markdown_table(["streams", "window eager GPU ms", "window compile GPU ms", "window compile folded GPU ms",
                                 "window snac-fast GPU ms",
                                 "engine replay GPU ms", "engine pipelined ms/step", "faster compile GPU ms per audio s",
                                 "engine GPU ms per audio s", "real-time streams: faster compile", "engine (pipelined)"], rows))
    if any("load" in row for row in r["rows"]):
        lines.append(f"\nSimulated load (engine through AsyncStreamBatcher, max_wait 2 ms; each stream pushes a frame every "
                     f"{r['frame_interval_ms']:.1f} ms):\n")
        rows = [[row["streams"], f"{row['load']['p50_ms']:.2f}", f"{row['load']['p99_ms']:.2f}",
                 f"{row['load']['time_to_first_audio_ms']:.1f}", row["load"]["batches"],
                 f"{row['load'].get('engine_call_max_ms', float('nan')):.1f}",
                 f"{row['load'].get('gc_gen2_collections', '-')} / {row['load'].get('gc_gen2_max_pause_ms', float('nan')):.1f}",
                 row["load"].get("graphs_captured_during_load", "-")] for row in r["rows"] if "load" in row]
        lines.append(markdown_table(["streams", "push->audio p50 ms", "p99 ms", "time to first audio ms", "engine calls",
                                     "longest engine call ms", "gc full collections / longest ms", "graphs captured"], rows))
        if r.get("gc_freeze"):
            lines.append("\ngc.freeze() ran before each load (objects made until then leave the collector's scans).\n")
    f = r["fidelity"]
    lines.append(f"\nFidelity (B=1, same seed): fp32 stream vs fp32 decode {f['stream_fp32_vs_offline_fp32_db']:.1f} dB; "
                 f"fp16 stream vs fp32 decode {f['stream_fp16_vs_offline_fp32_db']:.2f} dB; fp16 decode vs fp32 decode "
                 f"{f['offline_fp16_vs_offline_fp32_db']:.2f} dB. Peak memory {r['peak_memory_mib']:.0f} MiB.\n")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
