"""CPU streams side by side: snac-fast's exact stream (state per layer, eager and through
torch.compile; the stage step it replaced on CPUs) against the window glue CPU users run: upstream
SNAC decoding a 4-frame window per frame in torch (eager, and under torch.compile for that one
shape), and the same windows through ONNX Runtime (the upstream decoder exported with torch.onnx:
orpheus-cpp's path).

Per thread count: one stream's time a frame (a push of one frame, the LM's pace; windows: one
window decode a frame), and real-time streams per core: snac-fast with ``--streams`` streams a step
(one engine batching them), the windows one session per stream. ``--procs P``: P processes run each
measurement at once (a many-core host: e.g. 16 processes of 1 thread); the first process warms up
(compiles) alone and the others then find its compiled code in Inductor's cache, instead of 16
compiles of the same graphs at once. Rounds interleave the contenders (order reversed every other
round); each figure is the median of the rounds' medians.

    python scripts/bench_cpu.py --threads 1,2 --streams 1,16 --out benchmarks --stem cpu_stream_24khz_2core
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import platform
from queue import SimpleQueue
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from bench_common import markdown_table, write_results

WINDOW = 4  # frames a window decode takes (orpheus-cpp, Orpheus-FastAPI: 28 tokens), its middle frame kept


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def export_onnx(model, config: dict, path: Path) -> None:
    """The upstream decoder, codes of a 4-frame window -> audio, exported by torch.onnx (dynamo)."""

    class Decode(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, *codes):
            return self.m.decode(list(codes))

    strides = config["vq_strides"]
    codes = tuple(torch.zeros((1, WINDOW * strides[0] // s), dtype=torch.int64) for s in strides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Decode(model).eval(), codes, str(path), input_names=[f"codes_{i}" for i in range(len(codes))],
                          output_names=["audio"], dynamo=True, verbose=False)


class Bench:
    """One process's models and contenders."""

    def __init__(self, cli, onnx_path: Path | None) -> None:
        from snac_fast import FastSNAC
        from snac_fast.model.loading import build_upstream, resolve_checkpoint

        self.cli = cli
        self.codec = FastSNAC.from_pretrained(f"synthetic:{cli.model}", device="cpu", dtype=torch.float32)
        self.upstream = build_upstream(resolve_checkpoint(f"synthetic:{cli.model}")).eval()
        self.config = self.codec.config
        self.strides = self.config["vq_strides"]
        self.frame_ms = 1000.0 * self.codec.hop_length * self.strides[0] / self.config["sampling_rate"]
        self.onnx_path = onnx_path
        # the strongest torch peer: upstream's decode compiled for the one window shape it runs
        self.compiled_upstream = torch.compile(self.upstream.decode, dynamic=False)
        self._sessions: dict[int, object] = {}
        self._engines: dict[tuple, object] = {}
        self.gen = torch.Generator().manual_seed(os.getpid())

    def codes(self, batch: int, frames: int) -> list[torch.Tensor]:
        V = self.config["codebook_size"]
        return [torch.randint(0, V, (batch, frames * self.strides[0] // s), generator=self.gen) for s in self.strides]

    def frames_of(self, codes, start: int, stop: int) -> list[torch.Tensor]:
        return [c[:, start * self.strides[0] // s:stop * self.strides[0] // s] for c, s in zip(codes, self.strides)]

    def stream(self, form: str, streams: int) -> list[float]:
        """ms a step of one frame for ``streams`` streams (one engine; form: layered, compiled, stages)."""
        key = (form, streams)
        if key not in self._engines:
            options = {"layered": form != "stages", "compile": form == "compiled"}
            self._engines[key] = self.codec.stream_engine(streams, **options)
        engine = self._engines[key]
        g = engine.frames_per_group
        frames = engine.prefill_frames + self.cli.frames * g
        codes = self.codes(streams, frames)
        slots = [engine.open(seed=i, row=0) for i in range(streams)]
        times = []
        with torch.inference_mode():
            engine.step(slots, self.frames_of(codes, 0, engine.prefill_frames))
            for f in range(engine.prefill_frames, frames, g):
                t0 = time.perf_counter()
                engine.step(slots, self.frames_of(codes, f, f + g))
                times.append((time.perf_counter() - t0) * 1e3 / g)
            engine.advance(finish=slots)
        return times

    def windows(self, runtime: str) -> list[float]:
        """ms a frame of one stream decoding a 4-frame window per frame (upstream in torch, eager or
        compiled, or ONNX Runtime)."""
        frames = WINDOW + self.cli.frames
        codes = self.codes(1, frames)
        times = []
        with torch.inference_mode():
            for f in range(WINDOW, frames):
                window = self.frames_of(codes, f - WINDOW, f)
                t0 = time.perf_counter()
                if runtime == "onnxruntime":
                    audio = self.session().run(None, {f"codes_{i}": c.numpy() for i, c in enumerate(window)})[0]
                elif runtime == "compiled":
                    audio = self.compiled_upstream(window)
                else:
                    audio = self.upstream.decode(window)
                audio[..., 2048:4096]  # the glue keeps the window's second frame
                times.append((time.perf_counter() - t0) * 1e3)
        return times

    def session(self):
        import onnxruntime as ort

        threads = torch.get_num_threads()
        if threads not in self._sessions:
            options = ort.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
            self._sessions[threads] = ort.InferenceSession(str(self.onnx_path), options, providers=["CPUExecutionProvider"])
        return self._sessions[threads]

    def exactness_db(self) -> float:
        """The per-layer float32 stream, one frame a push, against the whole decode (dB)."""
        from snac_fast.metrics import snr_db

        codes = self.codes(1, 40)
        stream = self.codec.stream(seed=3)
        with torch.inference_mode():
            audio = torch.cat([stream.push(self.frames_of(codes, f, f + 1)) for f in range(40)] + [stream.flush()])
            return snr_db(self.codec.decode(codes, seed=3)[0, 0], audio)


WINDOW_RUNTIMES = {"upstream": "upstream windows", "compiled": "compiled upstream windows",
                   "onnxruntime": "onnxruntime windows"}


def contenders(cli) -> list[tuple[str, int]]:
    """(name, streams a step) measured at every thread count."""
    out = []
    for form in cli.forms.split(","):
        out += [(form, b) for b in cli.streams]
    return out + [(WINDOW_RUNTIMES[runtime], 1) for runtime in cli.windows]


def measure(bench: Bench, name: str, streams: int) -> list[float]:
    if name.endswith("windows"):
        return bench.windows(name.split()[0] if name.startswith(("onnxruntime", "compiled")) else "torch")
    return bench.stream(name, streams)


def worker(cli, onnx_path, barrier, first_warm, queue, index: int) -> None:
    """One process: every contender once untimed (compiles, ONNX sessions, first touch; process 0
    first and alone, ``first_warm`` set after it), then the timed rounds in step with the others."""
    torch.manual_seed(index)
    if index > 0:
        # the processes after the first find its code in Inductor's cache: they compile in themselves,
        # not each through a pool of compile workers of its own (one per core: 15 pools of 16 on a
        # 16-core host, where they took 77-125 s to warm up against process 0's 114 s alone; 2026-12-07)
        from torch._inductor import config as inductor_config

        inductor_config.compile_threads = 1
    bench = Bench(cli, onnx_path)
    results = {}
    if first_warm is not None and index > 0:
        first_warm.wait()
    started = time.perf_counter()
    for threads in cli.threads:
        torch.set_num_threads(threads)
        for name, streams in contenders(cli):
            measure(bench, name, streams)
    print(f"process {index} warmed up in {time.perf_counter() - started:.1f} s", flush=True)
    if index == 0 and first_warm is not None:
        first_warm.set()
    for threads in cli.threads:
        torch.set_num_threads(threads)
        for r in range(cli.rounds):
            order = contenders(cli)
            for name, streams in order if r % 2 == 0 else order[::-1]:
                if barrier is not None:
                    barrier.wait()
                times = measure(bench, name, streams)
                results.setdefault((threads, name, streams), []).append(statistics.median(times[1:]))
    queue.put((index, results, bench.frame_ms, bench.exactness_db() if index == 0 else None))


def _onnxruntime_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="snac_24khz")
    parser.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16],
                        help="snac-fast streams a step")
    parser.add_argument("--forms", default="layered,compiled,stages", help="snac-fast step forms to measure")
    parser.add_argument("--procs", type=int, default=1, help="processes running each measurement at once")
    parser.add_argument("--frames", type=int, default=24, help="timed frames a measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--windows", type=lambda s: s.split(","), default=list(WINDOW_RUNTIMES),
                        help=f"window-glue peers to measure, of {','.join(WINDOW_RUNTIMES)}")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--stem", default="cpu_stream_24khz")
    cli = parser.parse_args()
    if not set(cli.windows) <= set(WINDOW_RUNTIMES):
        parser.error(f"--windows takes {','.join(WINDOW_RUNTIMES)}, got {','.join(cli.windows)}")
    cli.onnx = "onnxruntime" in cli.windows

    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = None
        if cli.onnx:
            from snac_fast.model.loading import build_upstream, resolve_checkpoint

            onnx_path = Path(tmp) / "snac_decoder.onnx"
            t0 = time.perf_counter()
            export_onnx(build_upstream(resolve_checkpoint(f"synthetic:{cli.model}")).eval(),
                        resolve_checkpoint(f"synthetic:{cli.model}").config, onnx_path)
            print(f"exported the upstream decoder to ONNX in {time.perf_counter() - t0:.1f} s", flush=True)
        queue = mp.get_context("spawn").SimpleQueue() if cli.procs > 1 else SimpleQueue()
        if cli.procs == 1:
            worker(cli, onnx_path, None, None, queue, 0)
        else:
            context = mp.get_context("spawn")
            barrier, first_warm = context.Barrier(cli.procs), context.Event()
            procs = [context.Process(target=worker, args=(cli, onnx_path, barrier, first_warm, queue, i))
                     for i in range(cli.procs)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            if any(p.exitcode for p in procs):
                raise SystemExit("a worker process failed")
        reports = [queue.get() for _ in range(cli.procs)]

    frame_ms = reports[0][2]
    exact_db = next(r[3] for r in reports if r[3] is not None)
    rows, records = [], []
    for threads in cli.threads:
        onnx_per_core = None
        for name, streams in contenders(cli):
            per_proc = [statistics.median(r[1][(threads, name, streams)]) for r in reports]
            ms = statistics.median(per_proc)
            rt_streams = sum(streams * frame_ms / m for m in per_proc)  # all processes together
            per_core = rt_streams / (cli.procs * threads)
            if name == "onnxruntime windows":
                onnx_per_core = per_core
            records.append({"threads": threads, "procs": cli.procs, "contender": name, "streams_a_step": streams,
                            "ms_a_frame_per_step": round(ms, 2), "ms_per_process": [round(m, 2) for m in per_proc],
                            "real_time_x": round(frame_ms / ms, 2), "real_time_streams": round(rt_streams, 1),
                            "real_time_streams_per_core": round(per_core, 2)})
        for rec in records:
            if rec["threads"] == threads and onnx_per_core:
                rec["per_core_vs_onnxruntime"] = round(rec["real_time_streams_per_core"] / onnx_per_core, 2)
    for rec in records:
        rows.append([rec["threads"], rec["contender"], rec["streams_a_step"], rec["ms_a_frame_per_step"],
                     rec["real_time_x"], rec["real_time_streams_per_core"], rec.get("per_core_vs_onnxruntime", "")])
    env = {"cpu": cpu_name(), "cores": os.cpu_count(), "procs": cli.procs, "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "onnxruntime": _onnxruntime_version() if cli.onnx else None,
           "python": platform.python_version(), "model": f"synthetic:{cli.model}", "dtype": "float32",
           "frame_ms": round(frame_ms, 2), "frames_a_measurement": cli.frames, "rounds": cli.rounds,
           "stream_vs_decode_db": round(exact_db, 1)}
    table = markdown_table(["threads", "contender", "streams a step", "ms a frame (a step)", "x real time",
                            "real-time streams a core", "a core vs ONNX Runtime"], rows)
    markdown = (f"# CPU streams, {cli.model} (synthetic weights), float32\n\n{env['cpu']}, {env['cores']} cores, "
                f"{cli.procs} process(es) at once, {env['date']}; torch {env['torch']}, onnxruntime "
                f"{env['onnxruntime']}. A frame is {frame_ms:.1f} ms of audio. The per-layer stream against the "
                f"whole decode: {env['stream_vs_decode_db']} dB.\n\n{table}\n"
                f"`python scripts/bench_cpu.py --threads {','.join(map(str, cli.threads))} --streams "
                f"{','.join(map(str, cli.streams))} --forms {cli.forms} --windows {','.join(cli.windows)} "
                f"--procs {cli.procs} --rounds {cli.rounds}`\n")
    print(markdown)
    if cli.out:
        write_results(cli.out, cli.stem, {"environment": env, "results": records}, markdown)


if __name__ == "__main__":
    main()
