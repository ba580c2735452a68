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
import random
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from snac_fast.serve.lm.fake import read_stats_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def load(port: int, streams: int, seconds: float, run_s: float) -> dict[str, float]:
    """Requests for ``run_s`` seconds; prompt text -> when its headers were written."""
    import aiohttp

    sent: dict[str, float] = {}

    async def on_sent(session, context, params) -> None:
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
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4 * streams), trace_configs=[trace]) as session:
        rng, tasks, at = random.Random(0), [], time.monotonic()
        for i in range(int(streams / seconds * run_s)):
            at += rng.expovariate(streams / seconds)
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            tasks.append(asyncio.create_task(one(session, i)))
        await asyncio.gather(*tasks)
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64, help="streams open at once, on average")
    parser.add_argument("--workers", type=int, default=1, help="fake LM processes")
    parser.add_argument("--seconds", type=float, default=3.0, help="audio per answer (real time)")
    parser.add_argument("--run-s", type=float, default=12.0, help="how long requests keep arriving")
    args = parser.parse_args()
    port, stats = free_port(), tempfile.mkdtemp()
    lm = subprocess.Popen([sys.executable, "-m", "snac_fast.serve.lm.fake", "--port", str(port), "--pace", "1",
                           "--frames", str(round(args.seconds / (2048 / 24000))), "--stats-dir", stats,
                           "--workers", str(args.workers)])
    try:
        for _ in range(300):  # up when it accepts a connection
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        time.sleep(1.0)  # every worker up
        sent = asyncio.run(load(port, args.streams, args.seconds, args.run_s))
    finally:
        lm.terminate()
        lm.wait(timeout=30)
    entries = read_stats_dir(stats)
    accept = np.array([(entries[k]["received"] - t) * 1e3 for k, t in sent.items() if k in entries])
    lags = np.concatenate([np.asarray(e.get("lags", []), float) for e in entries.values()] or [np.zeros(0)]) * 1e3
    result = {"streams": args.streams, "workers": args.workers, "requests": len(accept),
              **{f"accept_{name}_ms": round(float(f(accept)), 2) for name, f in
                 (("p50", lambda a: np.percentile(a, 50)), ("p99", lambda a: np.percentile(a, 99)), ("max", np.max))},
              **{f"loop_lag_{name}_ms": round(float(f(lags)), 2) for name, f in
                 (("p50", lambda a: np.percentile(a, 50)), ("p99", lambda a: np.percentile(a, 99)), ("max", np.max))}}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
