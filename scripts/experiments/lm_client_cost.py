"""Host CPU per LM chunk of the server's LM client: httpx (``LMClient``) against aiohttp, on
asyncio's event loop and on uvloop. A fake LM (``snac_fast.fake_lm``, another process) streams
Orpheus tokens at real time to ``--streams`` concurrent requests; this process reads them the way
``snac-fast serve`` does and reports its CPU time per SSE chunk (``time.process_time``) and the
share of one core it needed. No GPU: the LM side of serving is host work.

    python scripts/experiments/lm_client_cost.py --streams 64 --seconds 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_serve_http import free_port, start_fake_lm  # noqa: E402

from snac_fast.orpheus import ORPHEUS  # noqa: E402
from snac_fast.lm_client import ORPHEUS_PROMPT, LMClient, _ids_of_events, _sse_data  # noqa: E402
from snac_fast.server import ServeConfig  # noqa: E402


async def read_httpx(url: str, streams: int) -> int:
    """The LM client as it was before aiohttp: httpx's stream, the same SSE and token parsing."""
    import httpx

    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    chunks = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:
        async def one(i: int) -> None:
            nonlocal chunks
            body = {"model": "fake", "prompt": ORPHEUS_PROMPT.format(voice="tara", text=f"line {i}"), "stream": True}
            async with client.stream("POST", url + "/completions", json=body) as response:
                async for _ in _ids_of_events(_sse_data(response.aiter_bytes()), ORPHEUS.offset):
                    chunks += 1

        await asyncio.gather(*(one(i) for i in range(streams)))
    return chunks


async def read_aiohttp(url: str, streams: int) -> int:
    """The server's LMClient (aiohttp)."""
    client = LMClient(ServeConfig(lm_url=url, lm_model="fake", max_streams=streams))
    chunks = 0

    async def one(i: int) -> None:
        nonlocal chunks
        async for _ in client.ids(f"line {i}", "tara", None):
            chunks += 1

    await asyncio.gather(*(one(i) for i in range(streams)))
    await client.aclose()
    return chunks


def measure(kind: str, loop: str, url: str, streams: int) -> dict:
    reader = read_httpx if kind == "httpx" else read_aiohttp
    run = asyncio.run
    if loop == "uvloop":
        import uvloop

        run = uvloop.run
    cpu, wall = time.process_time(), time.perf_counter()
    chunks = run(reader(url, streams))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"client": kind, "loop": loop, "streams": streams, "chunks": chunks, "cpu_s": round(cpu, 3),
            "wall_s": round(wall, 3), "cpu_us_per_chunk": round(1e6 * cpu / max(chunks, 1), 1),
            "core_share": round(cpu / wall, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=8.0, help="audio per request (at real time)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    port = free_port()
    frames = round(args.seconds * 24000 / 2048)
    lm = start_fake_lm(port, 1, frames, Path("/tmp/lm_client_cost_lm.log"))
    results = []
    try:
        for _ in range(args.rounds):  # interleaved: each round runs every variant once
            for kind in ("httpx", "aiohttp"):
                for loop in ("asyncio", "uvloop"):
                    results.append(measure(kind, loop, f"http://127.0.0.1:{port}/v1", args.streams))
                    print(json.dumps(results[-1]), flush=True)
    finally:
        lm.terminate()
        lm.wait()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
