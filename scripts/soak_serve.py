"""`snac-fast serve` under faults for a long time: N clients for M minutes, each asking one thing after
another (short speech in pcm, mp3 or opus; long speech; an ids WebSocket; a text WebSocket), some
of them vanishing at a random point, while the fake LM fails, stalls or sends junk for a share of
its answers. Reports every request's outcome, the server's open slots, its processes' memory (RSS)
and GPU memory over time, and the healthy streams' chunk gaps beside the LM's own.

Outcomes: ``complete`` (the audio to its end: a clean end of body, ``{"type": "done"}`` or
``{"isFinal": true}``; pcm ones also checked byte for byte against the frames the LM sent),
``error`` (a clear one: an HTTP error in OpenAI's shape, a WebSocket error message or close reason,
a body cut short after its first audio), ``disconnected`` (the client left), ``lost`` (none of
these: what the server promises never to do).

    python scripts/soak_serve.py --clients 256 --minutes 30 --disconnect 0.1 --lm-faults 0.02,0.02,0.01 \\
        --workers 4 --shared-engine --max-streams 2048 --max-batch 512 --lm-workers 4 --client-procs 4 --out benchmarks
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import markdown_table, write_results
from bench_serve_http import free_port, gpu_mib_by_pid, lm_texts, process_tree, start, start_fake_lm, tree_cpu_seconds

from snac_fast.runtime.host_memory import status_bytes
from snac_fast.serve.lm.fake import FakeLM, read_stats_dir

FRAME_S = 2048 / 24000
KINDS = {"pcm": 0.40, "mp3": 0.12, "opus": 0.08, "long": 0.10, "ids_ws": 0.12, "text_ws": 0.18}
BOUND_S = 120.0  # a request with no progress for this long is lost


def sentence(tag: str, k: int) -> str:
    return f"{tag} says line {k}, which goes on for a little while."


async def one_request(session, server: str, kind: str, tag: str, abort_after: float | None) -> dict:
    """One request of ``kind``; abandoned after ``abort_after`` s if set."""
    record = {"kind": kind, "tag": tag, "start": time.monotonic(), "chunks": [], "outcome": "lost", "detail": ""}
    try:
        await asyncio.wait_for(_request(session, server, kind, tag, record), abort_after or BOUND_S * 10)
    except asyncio.TimeoutError:
        if abort_after is not None:
            record["outcome"] = "disconnected"
        else:
            record["detail"] = "no end in time"
    except Exception as e:  # noqa: BLE001 (every way a request can end is recorded)
        record["detail"] = f"{type(e).__name__}: {e}"[:200]
        cut = "payload is not completed" in str(e).lower() or "connection reset" in str(e).lower()
        if record["outcome"] == "lost" and record["chunks"] and cut:  # as documented: an audio body ends short
            record["outcome"], record["detail"] = "error", "the body ended short after audio"
    record["end"] = time.monotonic()
    return record


async def _request(session, server: str, kind: str, tag: str, record: dict) -> None:
    import base64

    import aiohttp

    if kind in ("pcm", "mp3", "opus", "long"):
        text = " ".join(sentence(tag, k) for k in range(12)) if kind == "long" else sentence(tag, 0)
        record["text"] = text
        body = {"input": text, "response_format": "pcm" if kind == "long" else kind}
        async with session.post(server + "/v1/audio/speech", json=body,
                                timeout=aiohttp.ClientTimeout(total=None, sock_read=BOUND_S)) as r:
            record["status"] = r.status
            if r.status != 200:
                error = (await r.json()).get("error", {})
                record["outcome"], record["detail"] = ("error", error.get("message", "")[:200]) if error.get("message") \
                    else ("lost", f"{r.status} without an error body")
                return
            async for chunk in r.content.iter_any():
                record["chunks"].append((time.monotonic(), len(chunk)))
        record["outcome"] = "complete"
        return
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    if kind == "ids_ws":  # a client that runs its own LM: ids at real time for ~3 s
        from snac_fast.orpheus import ORPHEUS

        rng = np.random.default_rng(abs(hash(tag)) % (1 << 31))
        codes = rng.integers(0, 4096, (36, 7))
        ids = (codes + ORPHEUS.offset + np.arange(7) * 4096).reshape(-1).tolist()
        async with connect(server.replace("http", "ws", 1) + "/v1/audio/stream", max_size=None) as ws:
            async def read():
                try:
                    async for message in ws:
                        if isinstance(message, bytes):
                            record["chunks"].append((time.monotonic(), len(message)))
                        elif json.loads(message).get("type") == "done":
                            record["outcome"] = "complete"
                        else:
                            record["detail"] = json.loads(message).get("message", "")[:200]
                except ConnectionClosed:  # this client left (its 1011 on the way out) or the server closed: judged below
                    pass
            reader = asyncio.create_task(read())
            for frame in range(36):
                await ws.send(json.dumps({"ids": ids[frame * 7:(frame + 1) * 7]}))
                await asyncio.sleep(FRAME_S)
            await ws.send(json.dumps({"end": True}))
            await reader
            if record["outcome"] != "complete" and ws.close_code not in (1000, None):
                record["outcome"], record["detail"] = "error", f"closed {ws.close_code}: {ws.close_reason}"
        return
    url = server.replace("http", "ws", 1) + "/v1/text-to-speech/tara/stream-input?output_format=pcm_24000"
    record["sentences"] = []
    async with connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"text": " "}))

        async def read():
            try:
                async for raw in ws:
                    message = json.loads(raw)
                    if message.get("audio"):
                        record["chunks"].append((time.monotonic(), len(base64.b64decode(message["audio"]))))
                    if message.get("isFinal"):
                        record["outcome"] = "complete"
                    if message.get("error"):
                        record["outcome"], record["detail"] = "error", message.get("message", "")[:200]
            except ConnectionClosed:
                pass
        reader = asyncio.create_task(read())
        for k in range(3):
            record["sentences"].append((time.monotonic(), sentence(tag, k)))
            await ws.send(json.dumps({"text": sentence(tag, k) + " "}))
            await asyncio.sleep(1.5)
        await ws.send(json.dumps({"text": ""}))
        await reader


async def run_client_group(server: str, indices: list[int], until: float, disconnect: float, seed: int) -> list[dict]:
    import aiohttp

    rng = random.Random(seed)
    records: list[dict] = []
    connector = aiohttp.TCPConnector(limit=len(indices) + 8)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def client(i: int) -> None:
            await asyncio.sleep(rng.random() * 5)  # a staggered start
            n = 0
            while time.monotonic() < until:
                kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
                abort = rng.uniform(0.2, 6.0) if rng.random() < disconnect else None
                records.append(await one_request(session, server, kind, f"soak c{i} r{n}", abort))
                n += 1
        await asyncio.gather(*(client(i) for i in indices))
    return records


def client_process(server: str, indices: list[int], until: float, disconnect: float, seed: int) -> list[dict]:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(run_client_group(server, indices, until, disconnect, seed))


def tree_memory(pid: int) -> tuple[float, float]:
    """(RSS MB of ``pid`` and its descendants, their GPU memory MB per nvidia-smi, NaN without it)."""
    tree = set(process_tree(pid))
    rss = sum(status_bytes("VmRSS", p) or 0 for p in tree) / (1 << 20)
    listed = gpu_mib_by_pid(timeout_s=10)
    gpu = float("nan") if listed is None else sum(mib for p, mib in listed.items() if p in tree)
    return rss, gpu


def main() -> None:
    import httpx

    # the tree the server runs: read now, not after a half-hour run in which the checkout may move
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip() or None
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--disconnect", type=float, default=0.10, help="share of requests the client abandons")
    parser.add_argument("--lm-faults", default="0.02,0.02,0.01", help="shares of LM answers that fail, stall, send junk")
    parser.add_argument("--lm-timeout", type=float, default=10.0, help="serve --lm-timeout (a stall lasts twice it)")
    parser.add_argument("--pace", type=float, default=1.0)
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between the server's samples")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--shared-engine", action="store_true")
    parser.add_argument("--max-streams", type=int, default=1024)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--device", default=None)
    parser.add_argument("--memory-trim", type=float, default=None, help="serve --memory-trim (seconds; its default if unset)")
    parser.add_argument("--model", default="synthetic:snac_24khz")
    parser.add_argument("--lm-workers", type=int, default=1)
    parser.add_argument("--client-procs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--stem", default=None)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="soak_serve_"))
    stats_dir = tempfile.mkdtemp(prefix="soak_lm_stats_")
    lm_port, port = free_port(), free_port()
    faults = [float(f) for f in args.lm_faults.split(",")]
    lm = start_fake_lm(lm_port, args.pace, 36, logs / "fake_lm.log", "--workers", str(args.lm_workers), "--stats-dir",
                       stats_dir, "--chars-per-second", "15", "--faults", args.lm_faults,
                       "--stall-seconds", f"{2 * args.lm_timeout:g}")
    options = ["--workers", str(args.workers), "--max-streams", str(args.max_streams), "--max-batch", str(args.max_batch),
               "--lm-timeout", f"{args.lm_timeout:g}", *(["--shared-engine"] if args.shared_engine else []),
               *(["--device", args.device] if args.device else []),
               *(["--memory-trim", f"{args.memory_trim:g}"] if args.memory_trim is not None else [])]
    server = start([sys.executable, "-m", "snac_fast.cli", "serve", "--model", args.model, "--port", str(port),
                    "--lm-url", f"http://127.0.0.1:{lm_port}/v1", *options], f"http://127.0.0.1:{port}/health",
                   logs / "server.log")
    url = f"http://127.0.0.1:{port}"
    samples, stop = [], threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        while not stop.wait(args.sample_s):
            try:
                health = httpx.get(url + "/health", timeout=10).json()
            except httpx.HTTPError as e:
                health = {"status": f"unreachable: {e}"}
            rss, gpu = tree_memory(server.pid)
            samples.append({"t_s": time.monotonic() - t0, "status": health.get("status"),
                            "open_streams": health.get("open_streams"), "slots_in_use": health.get("slots_in_use"),
                            "rss_mb": rss, "gpu_mb": gpu})
            print(samples[-1], flush=True)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cpu0 = tree_cpu_seconds(server.pid)
    until = time.monotonic() + args.minutes * 60
    procs = max(1, min(args.client_procs, args.clients))
    try:
        with mp.get_context("spawn").Pool(procs) as pool:
            parts = pool.starmap(client_process, [(url, list(range(k, args.clients, procs)), until, args.disconnect,
                                                   args.seed + k) for k in range(procs)])
        records = [r for part in parts for r in part]
        deadline = time.monotonic() + 60  # in-flight streams drain; the stalled LM answers time out
        while time.monotonic() < deadline:
            health = httpx.get(url + "/health", timeout=10).json()
            if not health["open_streams"] and not health["slots_in_use"]:
                break
            time.sleep(1)
        final = httpx.get(url + "/health", timeout=10).json()
        cpu = tree_cpu_seconds(server.pid) - cpu0
    finally:
        stop.set()
        server.terminate()
        lm.terminate()
        server.wait(60)
        lm.wait(10)
    wall = time.monotonic() - t0
    results = summarize(records, samples, final, read_stats_dir(stats_dir), faults, args)
    results.update(args=vars(args), server_cpu_cores=cpu / wall, samples=samples, logs=str(logs))
    try:
        import torch

        results["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        results["device"] = "unknown"
    results["date"] = time.strftime("%Y-%m-%d")
    results["commit"] = commit
    print({k: v for k, v in results.items() if k not in ("samples", "by_kind", "lost_examples", "error_examples")},
          flush=True)
    print(results["by_kind"], results["lost_examples"], results["error_examples"], flush=True)
    if args.out:
        tag = results["device"].lower().replace("nvidia ", "").replace(" ", "_").split("_")[0]
        write_results(Path(args.out), args.stem or f"soak_serve_24khz_{tag}", results, markdown(results))


def summarize(records: list[dict], samples: list[dict], final: dict, lm_stats: dict, faults: list[float], args) -> dict:
    """Outcomes by kind; completeness of the fault-free pcm answers; leaked slots; memory growth
    after the first minute; the healthy streams' chunk gaps beside the LM's."""
    lm = FakeLM(chars_per_second=15.0, faults=tuple(faults))  # the same draws as the fake LM's
    by_kind: dict[str, dict[str, int]] = {}
    for r in records:
        by_kind.setdefault(r["kind"], {"complete": 0, "error": 0, "disconnected": 0, "lost": 0})[r["outcome"]] += 1
    checked = short = 0
    gaps = []
    for r in records:
        if r["outcome"] != "complete" or r["kind"] not in ("pcm", "long", "text_ws", "ids_ws"):
            continue
        if len(r["chunks"]) > 1:
            gaps.append(np.diff([t for t, _ in r["chunks"]]) * 1e3)
        if r["kind"] in ("pcm", "long"):
            texts = lm_texts(r, 200)
            if any(lm._random_answer(t)["fault"] for t in texts) or not all(t in lm_stats for t in texts):
                continue
            frames = sum(lm_stats[t]["sends"][-1][1] // 7 for t in texts)
            checked += 1
            short += sum(n for _, n in r["chunks"]) != frames * 2048 * 2
    gaps = np.concatenate(gaps) if gaps else np.zeros(0)
    lm_gaps = np.concatenate([np.diff([t for t, _ in s["sends"]]) for s in lm_stats.values() if len(s["sends"]) > 1]
                             or [np.zeros(0)]) * 1e3
    after = [s for s in samples if s["t_s"] >= 60]
    growth = (lambda key: float(max(s[key] for s in after) / after[0][key] - 1) * 100
              if after and after[0][key] and np.isfinite(after[0][key]) else float("nan"))
    pct = (lambda a, q: float(np.percentile(a, q)) if len(a) else float("nan"))
    # the level beside the peaks: RSS rises and falls with what is live (a CPU call's activations,
    # up to ~30 MB), so a leak shows as the median's drift from the first five minutes after the
    # first to the last five
    def median(lo: float, hi: float) -> float:
        values = [s["rss_mb"] for s in samples if lo <= s["t_s"] < hi]
        return float(np.median(values)) if values else float("nan")
    def within_5pct(values: list[float]) -> list[int]:
        """[samples within 5% of their median, samples]: how many a flat target's band holds."""
        middle = float(np.median(values)) if values else float("nan")
        return [sum(abs(v / middle - 1) <= 0.05 for v in values), len(values)]
    end = samples[-1]["t_s"] if samples else 0.0
    rss_first, rss_last = median(60, 360), median(end - 300, end + 1)
    lost = [r for r in records if r["outcome"] == "lost"]
    return {"requests": len(records), "by_kind": by_kind,
            "outcomes": {o: sum(k[o] for k in by_kind.values()) for o in ("complete", "error", "disconnected", "lost")},
            "pcm_checked": checked, "pcm_short": short, "leaked_slots": final.get("slots_in_use"),
            "open_streams_after": final.get("open_streams"), "status_after": final.get("status"),
            "rss_growth_after_1min_pct": growth("rss_mb"), "gpu_growth_after_1min_pct": growth("gpu_mb"),
            "rss_band_after_1min_mb": [float(min(s["rss_mb"] for s in after)), float(max(s["rss_mb"] for s in after))]
            if after else None,
            "rss_median_minutes_1_6_mb": rss_first, "rss_median_last_5_minutes_mb": rss_last,
            "rss_median_drift_pct": (rss_last / rss_first - 1) * 100 if rss_first else float("nan"),
            "rss_within_5pct_of_median_after_1min": within_5pct([s["rss_mb"] for s in after]),
            "gap_p50_ms": pct(gaps, 50), "gap_p99_ms": pct(gaps, 99), "gap_max_ms": float(gaps.max()) if len(gaps) else float("nan"),
            "lm_gap_p99_ms": pct(lm_gaps, 99), "lm_gap_max_ms": float(lm_gaps.max()) if len(lm_gaps) else float("nan"),
            "lost_examples": [(r["kind"], r["detail"]) for r in lost[:10]],
            "error_examples": sorted({(r["kind"], r["detail"][:120]) for r in records if r["outcome"] == "error"})[:20]}


def markdown(results: dict) -> str:
    a = results["args"]
    rows = [[kind, *(counts[o] for o in ("complete", "error", "disconnected", "lost"))]
            for kind, counts in sorted(results["by_kind"].items())]
    return (f"# snac-fast serve soak ({results['device']}, {results['date']})\n\n"
            f"`python scripts/soak_serve.py --clients {a['clients']} --minutes {a['minutes']:g} --disconnect "
            f"{a['disconnect']:g} --lm-faults {a['lm_faults']} --lm-timeout {a['lm_timeout']:g} --workers {a['workers']}"
            f"{' --shared-engine' if a['shared_engine'] else ''} --max-streams {a['max_streams']} --max-batch "
            f"{a['max_batch']}`\n\n" + markdown_table(["kind", "complete", "clear error", "client left", "lost"], rows) +
            f"\n- Requests: {results['requests']}; fault-free pcm answers checked byte for byte: {results['pcm_checked']}, "
            f"short: {results['pcm_short']}.\n"
            f"- After the load: slots in use {results['leaked_slots']}, open streams {results['open_streams_after']}, "
            f"status {results['status_after']}.\n"
            f"- Memory after the first minute: RSS {results['rss_growth_after_1min_pct']:+.1f}%, GPU "
            f"{results['gpu_growth_after_1min_pct']:+.1f}% at most (the highest sample over the first after it); RSS "
            f"median {results['rss_median_minutes_1_6_mb']:.0f} MB in minutes 1-6, "
            f"{results['rss_median_last_5_minutes_mb']:.0f} MB in the last 5 ({results['rss_median_drift_pct']:+.1f}%); "
            f"{results['rss_within_5pct_of_median_after_1min'][0]} of {results['rss_within_5pct_of_median_after_1min'][1]} "
            "samples within 5% of their median.\n"
            f"- Healthy streams' chunk gaps p50 / p99 / max: {results['gap_p50_ms']:.1f} / {results['gap_p99_ms']:.1f} / "
            f"{results['gap_max_ms']:.1f} ms; the LM's own p99 / max {results['lm_gap_p99_ms']:.1f} / "
            f"{results['lm_gap_max_ms']:.1f} ms. Server CPU {results['server_cpu_cores']:.2f} cores.\n")


if __name__ == "__main__":
    main()
