"""Host CPU of `snac-fast serve` per audio chunk, the decoder left out: the server process runs the
real app (Starlette on uvicorn, the LM client, the batcher and its engine thread) over an engine
whose steps return silence at once, so what it measures is the Python a stream costs per frame of
audio: reading the LM's stream, framing and pushing the ids, the engine thread's bookkeeping, PCM
conversion and the streamed response. Three processes: the fake LM at real time, the server, and
clients reading PCM; the server's CPU time (``/proc``) over the audio chunks it sent, per event
loop (asyncio's, uvloop). No GPU.

    python scripts/experiments/serve_loop_cost.py --streams 64 --seconds 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_serve_http import free_port, start, start_fake_lm  # noqa: E402


class SilentEngine:
    """A real StreamEngine's slots, checks and framing, with steps that return silence at once."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step_rows(self, slots, rows, frames: int):
        import torch

        width = frames * self._engine.samples_per_frame
        return torch.zeros(len(slots) * width), np.arange(len(slots) + 1) * width

    def advance(self, pushes, slots):
        import torch

        return {slot: torch.zeros(self._engine.samples_per_frame) for slot in slots}


class SilentCodec:
    """What ``create_app`` reads of a codec, around a CPU FastSNAC of narrow widths."""

    def __init__(self, max_streams: int) -> None:
        from snac_fast import FastSNAC
        from snac_fast.synthetic import synthetic_model

        self._codec = FastSNAC(synthetic_model("snac_24khz", decoder_dim=64, encoder_dim=16), device="cpu")
        self.config, self.device = self._codec.config, self._codec.device
        self._engine = SilentEngine(self._codec.stream_engine(max_streams))

    def shared_stream_engine(self, lookahead=None, *, max_streams=None):
        return self._engine


def serve(port: int, lm_url: str, streams: int, loop: str) -> None:
    import uvicorn

    from snac_fast.server import ServeConfig, create_app

    app = create_app(SilentCodec(streams), ServeConfig(lm_url=lm_url, lm_model="fake", max_streams=streams,
                                                       max_batch=256))
    uvicorn.run(app, host="127.0.0.1", port=port, loop=loop, log_level="warning")


async def clients(url: str, streams: int) -> tuple[int, int]:
    import aiohttp

    chunks = total = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=streams + 8)) as session:
        async def one(i: int) -> None:
            nonlocal chunks, total
            body = {"input": f"line {i}", "response_format": "pcm", "seed": i}
            async with session.post(url + "/v1/audio/speech", json=body) as response:
                assert response.status == 200, await response.text()
                async for piece in response.content.iter_any():
                    chunks += 1
                    total += len(piece)

        await asyncio.gather(*(one(i) for i in range(streams)))
    return chunks, total


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(loop: str, lm_url: str, streams: int, seconds: float, profile: str | None = None) -> dict:
    port = free_port()
    server = start([sys.executable, __file__, "--serve", str(port), "--lm-url", lm_url, "--streams", str(streams),
                    "--loop", loop], f"http://127.0.0.1:{port}/health", Path(f"/tmp/serve_loop_cost_{loop}.log"))
    spy = None
    if profile:  # py-spy's raw stacks of every thread, for scripts/fold_profile.py
        spy = subprocess.Popen(["py-spy", "record", "--pid", str(server.pid), "--threads", "--rate", "200", "-f", "raw",
                                "-o", profile, "--duration", str(int(seconds))], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        before, wall = cpu_seconds(server.pid), time.perf_counter()
        chunks, total = asyncio.run(clients(f"http://127.0.0.1:{port}", streams))
        wall = time.perf_counter() - wall
        cpu = cpu_seconds(server.pid) - before
        if spy is not None:
            spy.wait()
    finally:
        server.terminate()
        server.wait()
    frames = total / 2 / 2048  # int16 PCM, 2,048 samples a frame
    return {"loop": loop, "streams": streams, "audio_s_per_stream": seconds, "wall_s": round(wall, 2),
            "frames": round(frames), "server_cpu_s": round(cpu, 3),
            "server_cpu_us_per_frame": round(1e6 * cpu / frames, 1), "server_core_share": round(cpu / wall, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=6.0, help="audio per request (at real time)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--loops", default="asyncio,uvloop")
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="py-spy raw profile of the server (each run overwrites it: use with --rounds 1 and one loop)")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the server process
    parser.add_argument("--lm-url", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--loop", default="asyncio", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.lm_url, args.streams, args.loop)
        return
    lm_port = free_port()
    frames = round(args.seconds * 24000 / 2048)
    lm = start_fake_lm(lm_port, 1, frames, Path("/tmp/serve_loop_cost_lm.log"))
    results = []
    try:
        for _ in range(args.rounds):
            for loop in args.loops.split(","):
                results.append(measure(loop, f"http://127.0.0.1:{lm_port}/v1", args.streams, args.seconds, args.profile))
                print(json.dumps(results[-1]), flush=True)
    finally:
        lm.terminate()
        lm.wait()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
