"""`snac-fast serve` under load: concurrent HTTP clients asking for speech from a fake LM at a set pace.

Three processes: the fake LM (``python -m snac_fast.fake_lm``, tokens at ``--pace`` times real time),
the server (``snac-fast serve`` on the synthetic model, ``--workers`` processes), and this one, whose
clients post ``/v1/audio/speech`` (int16 PCM, streamed), staggered over one frame, and time every
chunk. Reported per client count:

- time to first audio added by the server: first audio byte at the client minus the moment the LM
  sent the token that completed the first decodable frames (``time.monotonic()``, one host);
- gaps between audio chunks at the client (p50/p99/max) and how many exceed one frame of audio;
- real time: each stream's last audio byte against its LM's last token (the audio that waits for
  the stream's end comes out with the flush), and whether every stream got all its audio;
- the server's own push-to-audio histogram (/metrics).

    python scripts/bench_serve_http.py --clients 64,256,1024 --pace 1 --seconds 20 --out benchmarks
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import markdown_table, write_results  # noqa: E402

FRAME_S = 2048 / 24000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], health: str, timeout: float = 600.0) -> subprocess.Popen:
    import httpx

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(health, timeout=1).status_code < 500:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{cmd[:4]} did not come up in {timeout:.0f} s")


async def run_clients(server: str, clients: int, tag: str) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=30.0), limits=limits) as client:
        async def one(i: int) -> dict:
            await asyncio.sleep(FRAME_S * i / clients)  # staggered over one frame
            text = f"{tag} client {i}"
            record = {"text": text, "start": time.monotonic(), "chunks": []}
            async with client.stream("POST", server + "/v1/audio/speech",
                                     json={"model": "orpheus", "input": text, "response_format": "pcm"}) as r:
                record["status"] = r.status_code
                async for chunk in r.aiter_raw():
                    record["chunks"].append((time.monotonic(), len(chunk)))
            record["end"] = time.monotonic()
            return record
        return await asyncio.gather(*(one(i) for i in range(clients)))


def summarize(records: list[dict], first_sent: dict, frames: int, scrape: str) -> dict:
    ok = [r for r in records if r["status"] == 200]
    ttfa = [(r["chunks"][0][0] - first_sent[r["text"]]) * 1e3 for r in ok if r["chunks"] and r["text"] in first_sent]
    gaps = np.concatenate([np.diff([t for t, _ in r["chunks"]]) * 1e3 for r in ok if len(r["chunks"]) > 1] or [np.zeros(0)])
    want_bytes = frames * 2048 * 2
    complete = sum(1 for r in ok if sum(n for _, n in r["chunks"]) == want_bytes)
    pct = (lambda a, q: float(np.percentile(a, q)) if len(a) else float("nan"))
    return {"clients": len(records), "ok": len(ok), "complete_audio": complete,
            "ttfa_p50_ms": pct(ttfa, 50), "ttfa_p99_ms": pct(ttfa, 99), "ttfa_max_ms": max(ttfa, default=float("nan")),
            "gap_p50_ms": pct(gaps, 50), "gap_p99_ms": pct(gaps, 99), "gap_max_ms": float(gaps.max()) if len(gaps) else float("nan"),
            "gaps_over_frame": int((gaps > FRAME_S * 1e3).sum()), "gaps": int(len(gaps)),
            "server_push_histogram": [line for line in scrape.splitlines()
                                      if line.startswith(("snac_fast_push_seconds_bucket", "snac_fast_late_chunks_total",
                                                          "snac_fast_first_audio_seconds_count"))]}


def main() -> None:
    import httpx

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="64,256")
    parser.add_argument("--pace", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=20.0, help="audio per request")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--max-streams", type=int, default=1024, help="per worker")
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    frames = int(args.seconds / FRAME_S)
    lm_port, port = free_port(), free_port()
    lm = start([sys.executable, "-m", "snac_fast.fake_lm", "--port", str(lm_port), "--pace", str(args.pace),
                "--frames", str(frames)], f"http://127.0.0.1:{lm_port}/stats")
    t0 = time.monotonic()
    serve = [sys.executable, "-m", "snac_fast.cli", "serve", "--model", "synthetic:snac_24khz", "--port", str(port),
             "--lm-url", f"http://127.0.0.1:{lm_port}/v1", "--workers", str(args.workers),
             "--max-streams", str(args.max_streams), "--max-batch", str(args.max_batch)]
    if args.device:
        serve += ["--device", args.device]
    server = start(serve, f"http://127.0.0.1:{port}/health")
    results = {"args": vars(args), "server_start_s": time.monotonic() - t0, "rows": []}
    try:
        for clients in [int(c) for c in args.clients.split(",")]:
            records = asyncio.run(run_clients(f"http://127.0.0.1:{port}", clients, f"run{clients}"))
            first_sent = httpx.get(f"http://127.0.0.1:{lm_port}/stats").json()["first_sent"]
            scrape = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            row = summarize(records, first_sent, frames, scrape)
            results["rows"].append(row)
            print({k: v for k, v in row.items() if k != "server_push_histogram"}, flush=True)
    finally:
        server.terminate()
        lm.terminate()
        server.wait(60)
        lm.wait(10)
    try:
        import torch

        results["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        results["device"] = "unknown"
    results["date"] = time.strftime("%Y-%m-%d")
    if args.out:
        rows = [[r["clients"], f"{r['ok']} / {r['complete_audio']}", f"{r['ttfa_p50_ms']:.1f}", f"{r['ttfa_p99_ms']:.1f}",
                 f"{r['ttfa_max_ms']:.1f}", f"{r['gap_p50_ms']:.1f}", f"{r['gap_p99_ms']:.1f}", f"{r['gap_max_ms']:.1f}",
                 f"{r['gaps_over_frame']} of {r['gaps']}"] for r in results["rows"]]
        md = (f"# snac-fast serve under load ({results['device']}, {results['date']})\n\n"
              f"`python scripts/bench_serve_http.py --clients {args.clients} --pace {args.pace:g} --seconds {args.seconds:g} "
              f"--workers {args.workers}`: fake LM at {args.pace:g}x real time, {frames} frames per request, int16 PCM.\n\n"
              + markdown_table(["clients", "200 / complete audio", "TTFA added p50 ms", "p99", "max", "chunk gap p50 ms",
                                "p99", "max", "gaps over one frame"], rows))
        name = results["device"]
        tag = "h200" if "H200" in name else "h100" if "H100" in name else name.lower().replace(" ", "_")
        write_results(Path(args.out), f"serve_http_24khz_{tag}", results, md)


if __name__ == "__main__":
    main()
