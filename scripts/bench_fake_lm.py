"""The fake LM alone under the load one of its workers meets in `bench_serve_http.py`: streaming
completions arriving as a Poisson process, as many open at once as ``--streams`` on average, each
``--seconds`` of audio at real time. Prints how long each request waited from its headers written
(aiohttp's trace, the serve side's ``lm_sent_at``) to the LM's handler starting (the ``lm_accept``
part of first audio), and how late the LM's event loop woke from its waits between chunks:

    python scripts/bench_fake_lm.py --streams 256 --workers 1

What it showed (docs/history.md): the stand-in's own full garbage collections (torch's ~180k start-up
objects, unfrozen) stalled its loop 60-200 ms, which the server's first audio was charged for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_serve_http import FRAME_S, arrival_offsets, free_port, start_fake_lm

from snac_fast.serve.lm.fake import read_stats_dir


async def load(port: int, offsets: list[float], warm: int = 0) -> dict[str, float]:
    """One request at each of ``offsets`` (s after the start); prompt text -> when its headers were
    written. ``warm``: that many connections opened first (concurrent ``GET /v1/models``) and left
    idle in the pool, so that the load's requests go out on connections the LM has accepted already."""
    import aiohttp

    sent: dict[str, float] = {}

    async def on_sent(session, context, params) -> None:
        if context.trace_request_ctx is not None:  # the warm-up's GETs carry none
            context.trace_request_ctx["sent"] = time.monotonic()

    async def one(session, i: int) -> None:
        text, marks = f"request {i}", {}
        body = {"model": "orpheus", "prompt": f"<|begin_of_text|>tara: {text}<|eot_id|>", "stream": True,
                "max_tokens": 4096}
        async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body, trace_request_ctx=marks) as r:
            async for _ in r.content.iter_any():
                pass
        sent[text] = marks["sent"]

    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(on_sent)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=len(offsets)), trace_configs=[trace]) as session:
        async def models() -> None:
            async with session.get(f"http://127.0.0.1:{port}/v1/models") as r:
                await r.read()
                await asyncio.sleep(0.2)  # held, so that the others open connections of their own
        await asyncio.gather(*(models() for _ in range(warm)))
        tasks, t0 = [], time.monotonic()
        for i, offset in enumerate(offsets):
            await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
            tasks.append(asyncio.create_task(one(session, i)))
        await asyncio.gather(*tasks)
    return sent


def percentiles(name: str, values_ms: np.ndarray) -> dict[str, float]:
    return {f"{name}_p50_ms": round(float(np.percentile(values_ms, 50)), 2),
            f"{name}_p99_ms": round(float(np.percentile(values_ms, 99)), 2),
            f"{name}_max_ms": round(float(values_ms.max()), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64, help="streams open at once, on average")
    parser.add_argument("--workers", type=int, default=1, help="fake LM processes")
    parser.add_argument("--seconds", type=float, default=3.0, help="audio per answer (real time)")
    parser.add_argument("--run-s", type=float, default=12.0, help="how long requests keep arriving")
    parser.add_argument("--arrivals", default="poisson", choices=("poisson", "stagger", "burst"),
                        help="the requests' arrivals (bench_serve_http.py's)")
    parser.add_argument("--warm", type=int, default=0, help="connections opened and left idle before the load")
    args = parser.parse_args()
    port, stats = free_port(), tempfile.mkdtemp()
    requests = int(args.streams / args.seconds * args.run_s) if args.arrivals == "poisson" else args.streams
    # poisson: a process of rate streams / seconds, about ``streams`` answers in flight at once;
    # stagger and burst: ``streams`` requests within one frame, or at once
    offsets = arrival_offsets(requests, args.arrivals, args.seconds * requests / args.streams, seed=0)
    lm = start_fake_lm(port, 1.0, round(args.seconds / FRAME_S), Path(stats) / "fake_lm.log", "--stats-dir", stats,
                       "--workers", str(args.workers))
    try:
        time.sleep(1.0)  # every worker up, not only the one that answered
        sent = asyncio.run(load(port, offsets, args.warm))
    finally:
        lm.terminate()
        lm.wait(timeout=30)
    entries = read_stats_dir(stats)
    accept = np.array([(entries[k]["received"] - t) * 1e3 for k, t in sent.items() if k in entries])
    lags = np.concatenate([np.asarray(e.get("lags", []), float) for e in entries.values()] or [np.zeros(0)]) * 1e3
    print(json.dumps({"streams": args.streams, "workers": args.workers, "arrivals": args.arrivals, "warm": args.warm,
                      "requests": len(accept),
                      **percentiles("accept", accept), **percentiles("loop_lag", lags)}))


if __name__ == "__main__":
    main()
