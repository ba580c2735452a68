"""`snac-fast serve` under load: concurrent HTTP clients asking for speech from a fake LM at a set pace.

Three processes: the fake LM (``python -m snac_fast.serve.lm.fake``, tokens at ``--pace`` times real time),
the server (``snac-fast serve`` on the synthetic model, ``--workers`` processes), and this one, whose
clients post ``/v1/audio/speech`` (int16 PCM, streamed), staggered over one frame, and time every
chunk. Reported per client count:

- time to first audio added by the server: first audio byte at the client minus the moment the LM
  sent the token that completed the first decodable frames (``time.monotonic()``, one host);
- gaps between audio chunks at the client (p50/p99/max) and how many exceed one frame of audio;
- real time: how long after its nominal length (frames / pace) each stream's last byte came (the
  audio that waits for the stream's end comes out with the flush), and whether every stream got all
  its audio;
- the server's own push-to-audio histogram (/metrics).

One Python process cannot stream a thousand SSE answers nor read a thousand PCM streams at real time,
so the fake LM (``--lm-workers``) and the clients (``--client-procs``) can run in several processes;
times are ``time.monotonic()``, one clock for all processes of the host.

    python scripts/bench_serve_http.py --clients 64,256,1024 --pace 1 --seconds 20 --out benchmarks
"""

from __future__ import annotations

import argparse
import importlib
import asyncio
import multiprocessing as mp
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from snac_fast.batching.batchers import freeze_startup_objects
from snac_fast.runtime.process_name import ENGINE_NAME, WORKER_NAME
from snac_fast.serve.lm.fake import read_stats_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
import colocated_lm  # noqa: E402
from bench_common import gpu_tag, markdown_table, write_results

FRAME_S = 2048 / 24000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], health: str, log: Path, timeout: float = 600.0) -> subprocess.Popen:
    """Start ``cmd`` with its output to ``log`` (a pipe nobody reads would fill with access-log lines
    and block the server), and wait until ``health`` answers."""
    import httpx

    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(health, timeout=1).status_code < 500:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{cmd[:4]} did not come up in {timeout:.0f} s")


def start_fake_lm(port: int, pace: float, frames: int, log: Path, *options: str) -> subprocess.Popen:
    """``python -m snac_fast.serve.lm.fake`` on ``port`` (more ``options`` as on its command line), up."""
    return start([sys.executable, "-m", "snac_fast.serve.lm.fake", "--port", str(port), "--pace", str(pace),
                  "--frames", str(frames), *options], f"http://127.0.0.1:{port}/stats", log)


def arrival_offsets(clients: int, arrivals: str, seconds: float, seed: int) -> list[float]:
    """When each client sends its request (s after the start): ``stagger``, evenly over one frame;
    ``burst``, all at once; ``poisson``, a Poisson process of rate ``clients / seconds`` (about
    ``clients`` requests of ``seconds`` of audio in flight at once)."""
    if arrivals == "burst":
        return [0.0] * clients
    if arrivals == "poisson":
        gaps = np.random.default_rng(seed).exponential(seconds / clients, clients)
        return (np.cumsum(gaps) - gaps[0]).tolist()
    return [FRAME_S * i / clients for i in range(clients)]


def server_timing(header: str | None) -> dict[str, float]:
    """``Server-Timing: name;dur=ms, ...`` -> {name: ms}."""
    out = {}
    for part in (header or "").split(","):
        name, _, rest = part.strip().partition(";dur=")
        if rest:
            out[name] = float(rest)
    return out


def request_text(tag: str, i: int, chars: int) -> str:
    """Client i's input: one short line, or sentences up to about ``chars`` characters (long input)."""
    if not chars:
        return f"{tag} client {i}"
    sentences, text = 0, ""
    while len(text) < chars:
        text += f"{tag} client {i} says sentence {sentences}, which runs on for a while before it ends. "
        sentences += 1
    return text.strip()


async def run_clients(server: str, indices: list[int], offsets: list[float], tag: str, t_start: float,
                      request: dict) -> list[dict]:
    """aiohttp clients (a third of httpx's host time per chunk: the clients share the server's host),
    posting speech; or, with ``request["text_ws"]``, text WebSockets fed a sentence at a time."""
    import aiohttp

    if request.get("text_ws"):
        return await asyncio.gather(*(text_ws_client(server, i, offset, tag, t_start, **request["text_ws"])
                                      for i, offset in zip(indices, offsets)))
    timeout = aiohttp.ClientTimeout(total=None, connect=30.0, sock_read=300.0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=len(indices) + 8), timeout=timeout) as session:
        async def one(i: int, offset: float) -> dict:
            await asyncio.sleep(max(0.0, t_start + offset - time.monotonic()))
            text = request_text(tag, i, request.get("input_chars", 0))
            record = {"text": text, "start": time.monotonic(), "chunks": []}
            async with session.post(server + "/v1/audio/speech",
                                    json={"model": "orpheus", "input": text, "response_format": request["format"]}) as r:
                record["status"] = r.status
                record["server_timing"] = server_timing(r.headers.get("Server-Timing"))
                async for chunk in r.content.iter_any():
                    record["chunks"].append((time.monotonic(), len(chunk)))
            record["end"] = time.monotonic()
            return record
        return await asyncio.gather(*(one(i, offset) for i, offset in zip(indices, offsets)))


async def text_ws_client(server: str, i: int, offset: float, tag: str, t_start: float, sentences: int,
                         every: float) -> dict:
    """One voice agent on ``WS /v1/text-to-speech/tara/stream-input`` (pcm_24000): a sentence every
    ``every`` seconds, then the end; each audio message timed, each sentence's send time kept."""
    import base64
    import json

    from websockets.asyncio.client import connect

    await asyncio.sleep(max(0.0, t_start + offset - time.monotonic()))
    record = {"text": f"{tag} client {i}", "start": time.monotonic(), "chunks": [], "sentences": [], "status": 0}
    url = server.replace("http", "ws", 1) + "/v1/text-to-speech/tara/stream-input?output_format=pcm_24000"
    async with connect(url, max_size=None, open_timeout=60) as ws:
        await ws.send(json.dumps({"text": " "}))

        async def read() -> None:
            async for raw in ws:
                message = json.loads(raw)
                if message.get("audio"):
                    record["chunks"].append((time.monotonic(), len(base64.b64decode(message["audio"]))))
                if message.get("isFinal"):
                    record["status"] = 200
                    return
        reader = asyncio.create_task(read())
        for j in range(sentences):
            sentence = f"{tag} client {i} sentence {j} is a line the agent's model just wrote."
            record["sentences"].append((time.monotonic(), sentence))
            await ws.send(json.dumps({"text": sentence + " "}))
            await asyncio.sleep(every)
        await ws.send(json.dumps({"text": ""}))
        await reader
    record["end"] = time.monotonic()
    return record


def client_process(server: str, indices: list[int], offsets: list[float], tag: str, t_start: float,
                   request: dict) -> list[dict]:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    # this script's imports (torch's among them) out of the collector's scans, as in the server and the
    # fake LM: a full collection held a client's loop 60-100 ms, and its chunks were timed that late
    freeze_startup_objects()
    return asyncio.run(run_clients(server, indices, offsets, tag, t_start, request))


def all_clients(server: str, offsets: list[float], tag: str, procs: int, request: dict) -> list[dict]:
    """One client per offset, over ``procs`` processes (client i in process i % procs), one schedule."""
    clients = len(offsets)
    procs = min(procs, clients)
    t_start = time.monotonic() + (5.0 if procs > 1 else 0.2)  # time for the processes to start
    if procs == 1:
        return client_process(server, list(range(clients)), offsets, tag, t_start, request)
    with mp.get_context("spawn").Pool(procs) as pool:
        parts = pool.starmap(client_process, [(server, list(range(k, clients, procs)), offsets[k::procs], tag, t_start,
                                                request) for k in range(procs)])
    return [r for part in parts for r in part]


def process_tree(pid: int) -> dict[int, float]:
    """Process ``pid`` and every descendant alive now: pid -> CPU seconds (user + system) so far (/proc)."""
    import os

    parents, cpu = {}, {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    tree, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return {p: cpu.get(p, 0.0) for p in tree}


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid`` and its descendants (:func:`process_tree`)."""
    return sum(process_tree(pid).values())


def tree_cpu_by_name(pid: int) -> dict[str, float]:
    """:func:`tree_cpu_seconds` by process name (``/proc/<pid>/comm``: serve names its engine process
    and workers, snac_fast/runtime/process_name.py; the rest keep their program's name)."""
    out: dict[str, float] = {}
    for p, seconds in process_tree(pid).items():
        try:
            name = open(f"/proc/{p}/comm").read().strip()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + seconds
    return out


def stream_geometry(lookahead: int | str | None = None) -> dict:
    """Where a 24 kHz stream's audio ends after n frames, and the frames its first audio needs, for
    ``lookahead`` (the synthetic model's geometry, on CPU)."""
    from snac_fast import FastSNAC
    from snac_fast.orpheus import ORPHEUS

    engine = FastSNAC.from_pretrained("synthetic:snac_24khz", device="cpu", fuse=False).stream_engine(
        max_streams=1, lookahead=lookahead)
    return {"frame_samples": engine.samples_per_frame, "lookahead": engine.lookahead_samples,
            "per_frame": ORPHEUS.frame_size, "first_frames": engine.first_audio_frames}


def ready_times(texts: list[str], lm_stats: dict, per_frame: int) -> tuple[np.ndarray, np.ndarray]:
    """One stream's LM answers (``texts``, in order) as one count of audio tokens: (counts, when the
    LM had sent each, time.monotonic). A later answer's tokens count after every earlier answer's
    whole frames, and are ready no earlier than those: its request overlaps the one before."""
    counts, times, base = [], [], 0
    for text in texts:
        sends = lm_stats[text]["sends"]
        counts += [base + n for _, n in sends]
        times += [t for t, _ in sends]
        base += sends[-1][1] // per_frame * per_frame if sends else 0
    return np.array(counts), np.maximum.accumulate(np.array(times, dtype=float))


def frame_sent_at(counts: np.ndarray, times: np.ndarray, frames: int, per_frame: int) -> float | None:
    """When the LM had sent the token completing a stream's first ``frames`` frames (:func:`ready_times`),
    or None past its last whole frame."""
    needed = frames * per_frame
    return float(times[np.searchsorted(counts, needed)]) if len(counts) and needed <= counts[-1] else None


def chunk_ready(record: dict, counts: np.ndarray, times: np.ndarray, frame_samples: int, lookahead: int,
                per_frame: int, first_frames: int = 0) -> list[float | None]:
    """Per audio chunk of one pcm response: when the LM had sent the token completing the frames the
    chunk needed (s, time.monotonic), or None for a chunk past the last whole frame (the flush's
    tail). A stream's audio after n frames ends at n * frame_samples - lookahead, so a chunk ending
    at sample S needed frames (S + lookahead) / frame_samples."""
    out, received = [], 0
    for _, size in record["chunks"]:
        received += size // 2  # int16
        out.append(frame_sent_at(counts, times, -(-(received + lookahead) // frame_samples), per_frame))
    return out


def chunk_delays(record: dict, ready: list[float | None]) -> list[float]:
    """Per audio chunk whose frames the LM completed at a known time (:func:`chunk_ready`), its
    arrival less that time (s): what the server and the way back added to it."""
    return [t - r for (t, _), r in zip(record["chunks"], ready) if r is not None]


def lm_paced(record: dict, counts: np.ndarray, times: np.ndarray, frame_samples: int, lookahead: int,
             per_frame: int, first_frames: int) -> dict:
    """The record's audio as a server adding nothing would have delivered it: each frame's samples
    when the LM had sent the token completing it (:func:`ready_times`), the flush's tail with the
    last. Frame by frame, not by the record's chunks: a late server's chunks hold several frames."""
    total = sum(size for _, size in record["chunks"]) // 2
    chunks, done, frame = [], 0, first_frames
    while frame * frame_samples - lookahead <= total and (sent := frame_sent_at(counts, times, frame, per_frame)) is not None:
        end = frame * frame_samples - lookahead
        chunks.append((sent, 2 * (end - done)))
        done, frame = end, frame + 1
    if done < total:
        chunks.append((chunks[-1][0] if chunks else record["chunks"][-1][0], 2 * (total - done)))
    return {"chunks": chunks}


def playback_stalls(record: dict, rate: int, buffer_s: float = 0.0) -> float:
    """Silence (s) a player would add that starts ``buffer_s`` after the first byte and plays on as
    bytes come."""
    chunks = record["chunks"]
    if not chunks:
        return 0.0
    start, stall, played = chunks[0][0] + buffer_s, 0.0, 0
    for t, size in chunks:
        due = start + stall + played / rate  # when the player runs out of what it has
        stall += max(0.0, t - due)
        played += size // 2
    return stall


def lm_texts(record: dict, segment_chars: int) -> list[str]:
    """The texts of the LM requests behind one client's audio, in order: a speech input's segments,
    a text WebSocket's sentences."""
    from snac_fast.serve.lm.segments import split_text

    if "sentences" in record:
        return [text for _, text in record["sentences"]]
    return split_text(record["text"], segment_chars)


def first_audio_parts(record: dict, stats: dict, geometry: dict) -> dict[str, float] | None:
    """One request's time to first audio (ms) and its parts, end to end: ``total`` (request sent,
    or a text WebSocket's first sentence sent, to the first audio byte at the client); ``lm_own``
    (the LM's time from its first request's arrival to the chunk completing the first decodable
    frames: not the server's); ``added`` (total - lm_own: what the server and HTTP add); and from
    the server's ``Server-Timing``: ``setup`` (arrival to the LM request), ``lm_client`` (the LM's
    part as the server saw it, less lm_own: connecting, transit, parsing, waits on the event loop),
    ``engine``, ``encode``, and ``http`` (total less the server's own span: accept, parsing, sending);
    ``lm_client`` split by the server's clock marks into ``lm_request`` (the server's LM request sent
    to the LM's handler starting) and ``lm_response`` (the LM's chunk sent to the server's having read
    it: mostly the server's event loop); ``lm_request`` split in turn into ``lm_send`` (the server's
    part: its request's task started, a pooled connection taken or a new one made, the headers
    written) and ``lm_accept`` (the LM's: its event loop reading the request to its handler)."""
    if not record["chunks"] or stats.get("received") is None:
        return None
    needed = geometry["first_frames"] * geometry["per_frame"]
    ready = next((t for t, whole in stats["sends"] if whole >= needed), None)
    if ready is None:  # an answer shorter than the first decodable frames: its audio comes with the flush
        return None
    sent = record["sentences"][0][0] if "sentences" in record else record["start"]
    total = (record["chunks"][0][0] - sent) * 1e3
    lm_own = (ready - stats["received"]) * 1e3
    timing = record.get("server_timing", {})
    parts = {"total": total, "lm_own": lm_own, "added": total - lm_own}
    if "total" in timing and "lm" in timing:
        parts.update(setup=timing["setup"], lm_client=timing["lm"] - lm_own, engine=timing.get("engine", float("nan")),
                     encode=timing.get("encode", float("nan")), http=total - timing["total"])
    if "lm_asked_at" in timing and "frames_ready_at" in timing:  # the server's clock is the host's monotonic one
        parts.update(lm_request=stats["received"] * 1e3 - timing["lm_asked_at"],
                     lm_response=timing["frames_ready_at"] - ready * 1e3)
    if "lm_sent_at" in timing:
        parts.update(lm_send=timing["lm_send"], lm_accept=stats["received"] * 1e3 - timing["lm_sent_at"])
    return parts


def summarize(records: list[dict], lm_stats: dict, pace: float, scrape: str, geometry: dict, pcm: bool = True,
              segment_chars: int = 200, buffer_s: float = 0.15) -> dict:
    """``pcm``: the responses are int16 PCM, so bytes say which samples a chunk holds (the chunk
    delays, stalls and completeness); for encoded formats those are left out (NaN). Each client's
    audio is as long as the whole frames its LM requests sent (the fake LM's record)."""
    ok = [r for r in records if r["status"] == 200]
    frame_ms = FRAME_S * 1e3
    pct = (lambda a, q: float(np.percentile(a, q)) if len(a) else float("nan"))
    texts = {r["text"]: lm_texts(r, segment_chars) for r in ok}
    known = [r for r in ok if all(t in lm_stats for t in texts[r["text"]])]
    parts = [p for r in known for p in [first_audio_parts(r, lm_stats[texts[r["text"]][0]], geometry)] if p is not None]
    first = {}
    for name in ("total", "lm_own", "added", "setup", "lm_client", "lm_request", "lm_send", "lm_accept", "lm_response",
                 "engine", "encode", "http"):
        values = [p[name] for p in parts if name in p and np.isfinite(p[name])]
        first.update({f"first_{name}_p50_ms": pct(values, 50), f"first_{name}_p99_ms": pct(values, 99),
                      f"first_{name}_max_ms": max(values, default=float("nan"))})
    # each pcm chunk timed from the LM token completing its frames, over all of a stream's LM answers
    sent = {r["text"]: ready_times(texts[r["text"]], lm_stats, geometry["per_frame"]) for r in known} if pcm else {}
    added = np.array([d for r in known if pcm
                      for d in chunk_delays(r, chunk_ready(r, *sent[r["text"]], **geometry))]) * 1e3
    gaps = np.concatenate([np.diff([t for t, _ in r["chunks"]]) * 1e3 for r in ok if len(r["chunks"]) > 1] or [np.zeros(0)])
    lm_gaps = np.concatenate([np.diff([t for t, n in stats["sends"]]) for stats in lm_stats.values()] or [np.zeros(0)]) * 1e3
    # the fake LM's event loop, late from its waits: how loaded the LM's own loop was (its accept waits on it)
    lm_lags = np.concatenate([np.asarray(stats.get("lags", []), dtype=float) for stats in lm_stats.values()] or [np.zeros(0)]) * 1e3
    stalls = np.array([playback_stalls(r, 24000, buffer_s) for r in ok if pcm]) * 1e3
    # the same players fed at the LM's pace (a server adding nothing): the stalls that are the LM's
    paced = np.array([playback_stalls(lm_paced(r, *sent[r["text"]], **geometry), 24000, buffer_s)
                      for r in known if pcm]) * 1e3
    frames = {r["text"]: sum(lm_stats[t]["sends"][-1][1] // geometry["per_frame"] for t in texts[r["text"]]
                             if lm_stats[t]["sends"]) for r in known}
    complete = sum(1 for r in known if sum(n for _, n in r["chunks"]) == frames[r["text"]] * geometry["frame_samples"] * 2) \
        if pcm else None
    # past the audio's nominal end: a speech request's start + its audio / pace (not for text WebSockets)
    over = [(r["end"] - r["start"] - frames[r["text"]] * FRAME_S / pace) * 1e3 for r in known if "sentences" not in r]
    return {"clients": len(records), "ok": len(ok), "complete_audio": complete, "first_audio_timed": len(parts), **first,
            "lm_requests_per_client": float(np.mean([len(texts[r["text"]]) for r in ok])) if ok else float("nan"),
            "audio_s_per_client": float(np.mean(list(frames.values()))) * FRAME_S if frames else float("nan"),
            "chunk_added_p50_ms": pct(added, 50), "chunk_added_p99_ms": pct(added, 99),
            "chunk_added_p999_ms": pct(added, 99.9), "chunk_added_max_ms": float(added.max()) if len(added) else float("nan"),
            "chunks_timed": len(added), "chunks_added_over_frame": int((added > frame_ms).sum()),
            "gap_p50_ms": pct(gaps, 50), "gap_p99_ms": pct(gaps, 99), "gap_max_ms": float(gaps.max()) if len(gaps) else float("nan"),
            "gaps_over_frame": int((gaps > frame_ms).sum()), "gaps": len(gaps),
            "lm_chunk_gap_p99_ms": pct(lm_gaps, 99), "lm_chunk_gap_max_ms": float(lm_gaps.max()) if len(lm_gaps) else float("nan"),
            "lm_loop_lag_p50_ms": pct(lm_lags, 50), "lm_loop_lag_p99_ms": pct(lm_lags, 99),
            "lm_loop_lag_max_ms": float(lm_lags.max()) if len(lm_lags) else float("nan"),
            "player_buffer_ms": buffer_s * 1e3,
            "streams_with_stall": int((stalls > 0).sum()), "stall_max_ms": float(stalls.max()) if len(stalls) else float("nan"),
            "streams_with_stall_at_lm_pace": int((paced > 0).sum()),
            "stall_at_lm_pace_max_ms": float(paced.max()) if len(paced) else float("nan"),
            "end_over_nominal_p99_ms": pct(over, 99), "end_over_nominal_max_ms": max(over, default=float("nan")),
            "server_push_histogram": [line for line in scrape.splitlines()
                                      if line.startswith(("snac_fast_push_seconds_bucket", "snac_fast_first_audio_seconds_bucket", "snac_fast_late_chunks_total",
                                                          "snac_fast_first_audio_seconds_count"))]}


def late_chunks(scrape: str) -> float:
    """The server's count of pushes whose audio took over a frame (its /metrics)."""
    return sum(float(line.split()[-1]) for line in scrape.splitlines() if line.startswith("snac_fast_late_chunks_total"))


def gpu_mib_by_pid(timeout_s: float) -> dict[int, float] | None:
    """nvidia-smi's GPU memory (MiB) of each process using a GPU, or None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {int(p): float(mib) for p, mib in (line.split(",") for line in out.strip().splitlines() if "," in line)}


def server_memory(port: int, pid: int) -> dict:
    """The server's GPU memory: its /health's figures, nvidia-smi's per process, and ``server_mib``,
    the sum of nvidia-smi's MiB over the server's process tree (workers and engine process; not a
    co-located LM's)."""
    import httpx

    reading = {"health": httpx.get(f"http://127.0.0.1:{port}/health").json().get("gpu_memory")}
    listed = gpu_mib_by_pid(timeout_s=30)
    if listed is None:
        return reading
    reading["nvidia_smi_mib"] = listed
    tree = process_tree(pid)
    reading["server_mib"] = sum(mib for p, mib in listed.items() if p in tree)
    return reading


def cpu_split(row: dict) -> str:
    """A row's server CPU per stream-second by process, where serve named them: " (engine E, workers
    W, other O)", or nothing."""
    split = row.get("server_cpu_ms_per_stream_s_by_process") or {}
    if not any(name in split for name in (ENGINE_NAME, WORKER_NAME)):
        return ""
    parts = {"engine": split.get(ENGINE_NAME, 0.0), "workers": split.get(WORKER_NAME, 0.0),
             "other": sum(v for name, v in split.items() if name not in (ENGINE_NAME, WORKER_NAME))}
    return " (" + ", ".join(f"{part} {ms:.1f}" for part, ms in parts.items()) + ")"


def _memory_cell(reading: dict | None) -> str:
    """A colocation row's memory: nvidia-smi MiB over the server's processes / allocator reserve GB."""
    if not reading:
        return "not read"
    mib = reading.get("server_mib")
    reserved = (reading.get("health") or {}).get("reserved_gb")
    return f"{'?' if mib is None else f'{mib:,.0f}'} / {'?' if reserved is None else f'{reserved:.2f}'}"


def serve_options(args) -> list[str]:
    """The options this run hands ``snac-fast serve`` (named as on both command lines)."""
    options = ["--workers", str(args.workers), "--max-streams", str(args.max_streams), "--max-batch", str(args.max_batch)]
    if args.device:
        options += ["--device", args.device]
    if args.cpu_threads:
        options += ["--cpu-threads", str(args.cpu_threads)]
    if args.shared_engine:
        options += ["--shared-engine"]
    if args.engine_calls != "auto":
        options += ["--engine-calls", args.engine_calls]
    if args.max_wait_ms is not None:
        options += ["--max-wait-ms", f"{args.max_wait_ms:g}"]
    if args.lookahead != "exact":
        options += ["--lookahead", args.lookahead]
    if args.gpu_memory_gb:
        options += ["--gpu-memory-gb", f"{args.gpu_memory_gb:g}"]
    if args.rows_per_pass is not None:
        options += ["--rows-per-pass", str(args.rows_per_pass)]
    if args.memory_trim is not None:
        options += ["--memory-trim", f"{args.memory_trim:g}"]
    if args.ws_compression:
        options += ["--ws-compression"]
    return options


def server_form(args) -> str:
    """The server's processes in words: workers, threads, the shared engine, the memory trim."""
    words = [f"{args.workers} worker{'s' if args.workers > 1 else ''}"]
    if args.cpu_threads:
        words.append(f"{args.cpu_threads} thread{'s' if args.cpu_threads > 1 else ''} each")
    if args.shared_engine:
        words.append("one engine process")
    if args.memory_trim is not None:
        words.append(f"--memory-trim {args.memory_trim:g}")
    if args.ws_compression:
        words.append("--ws-compression")
    return ", ".join(words)


def _ms(row: dict, name: str, *quantiles: str) -> str:
    return " / ".join(f"{row[f'first_{name}_{q}_ms']:.1f}" for q in quantiles)


def markdown(results: dict) -> str:
    """Both tables of a report: time to first audio by load, and keeping pace."""
    rows = results["rows"]
    # a column for the server's form where the rows' differ (runs of several forms appended)
    forms = [[r.get("server", "")] if len({r.get("server") for r in rows}) > 1 else [] for r in rows]
    server = ["server"] if forms and forms[0] else []
    first = [[*form, r["format"], f"{r['pace']:g}x", r["lookahead"], "in turn" if r["clients"] == 1 else r["arrivals"], r["clients"], f"{r['ok']} / {r['first_audio_timed']}",
              _ms(r, "total", "p50", "p99"), _ms(r, "lm_own", "p50", "p99"), f"**{_ms(r, 'added', 'p50', 'p99')}** / "
              f"{r['first_added_max_ms']:.1f}", " / ".join(f"{r[f'first_{n}_p99_ms']:.1f}" for n in
                                                          ("setup", "lm_client", "engine", "encode", "http")),
              "{:.1f} ({:.1f} / {:.1f}) / {:.1f}".format(*(r.get(f"first_{n}_p99_ms", float("nan")) for n in
                                                           ("lm_request", "lm_send", "lm_accept", "lm_response"))),
              f"{r.get('lm_loop_lag_p99_ms', float('nan')):.1f} / {r.get('lm_loop_lag_max_ms', float('nan')):.1f}"]
             for form, r in zip(forms, rows)]
    pace = [[*form, r["format"], f"{r['pace']:g}x", r["arrivals"], r["clients"],
             f"{r.get('audio_s_per_client', float('nan')):.0f} / {r.get('lm_requests_per_client', float('nan')):.1f}",
             r["ok"] if r["complete_audio"] is None else f"{r['ok']} / {r['complete_audio']}",
             f"{r['gap_p50_ms']:.1f} / {r['gap_p99_ms']:.1f} / {r['gap_max_ms']:.1f}",
             f"{r['lm_chunk_gap_p99_ms']:.1f} / {r['lm_chunk_gap_max_ms']:.1f}",
             (f"{r['streams_with_stall']} / {r['stall_max_ms']:.0f}" + (
                 f" ({r['streams_with_stall_at_lm_pace']} / {r['stall_at_lm_pace_max_ms']:.0f})"
                 if "streams_with_stall_at_lm_pace" in r else "")) if "player_buffer_ms" in r else "–",
             f"{r['end_over_nominal_p99_ms']:.0f} / {r['end_over_nominal_max_ms']:.0f}",
             f"{r['server_cpu_cores']:.2f} / {r['server_cpu_ms_per_stream_s']:.1f}" + cpu_split(r)]
            for form, r in zip(forms, rows) if r["seconds"] >= 10 or r.get("input_chars") or "text-ws" in r["format"]]
    out = (f"# snac-fast serve under load ({results['device']}, {results['date']})\n\n"
           f"Commands: {'; '.join(f'`{c}`' for c in results['commands'])}. A fake LM (1-4 tokens a chunk, at the "
           "pace shown), the server and the clients share one host; every time is `time.monotonic()` of that host.\n\n"
           "## Time to first audio\n\n"
           "Total: request sent to first audio byte, at the client. LM own: the LM's time from the request's arrival "
           "to the chunk completing the first decodable frames (4 frames exact; fewer with a lookahead). Added: total "
           "less the LM's own: what the server and HTTP add. Parts (the server's `Server-Timing` header): set-up "
           "(arrival to the LM request), LM client (the LM's span as the server saw it, less the LM's own), engine, "
           "encoder, HTTP (total less the server's span). The LM client's part split by the server's clock marks: "
           "request (the server's LM request sent to the LM's handler starting), split into send (the server's part: "
           "the request's task started, a pooled connection taken or one made, its headers written) and accept (the "
           "LM's event loop reading it to its handler); and response (the LM's chunk sent to the server's having read it: the server's event loop, mostly). LM loop lag: how late the "
           "fake LM's event loop woke from its waits between chunks (its own load; its accept waits on the same loop). Arrivals: `poisson` at clients / seconds-of-audio a second, "
           "`burst` all at once, `stagger` over one frame; 1 client: requests one after another.\n\n"
           + markdown_table([*server, "format", "LM pace", "lookahead", "arrivals", "clients", "200 / timed", "total p50 / p99 ms",
                             "LM own p50 / p99 ms", "added p50 / p99 / max ms",
                             "p99 ms: set-up / LM client / engine / encoder / HTTP",
                             "LM client p99 ms: request (send / accept) / response", "LM loop lag p99 / max ms"], first))
    if pace:
        out += ("\n## Keeping pace\n\n"
                "Chunk gaps between successive audio chunks at the client beside the LM's between its chunks; end past "
                "nominal: the last byte after the request's start + its audio / pace; server CPU: the server's processes "
                "while the load ran, per stream and second. Stalls: the silence a player starting 150 ms after the "
                "first byte would add; in brackets, the same players fed at the LM's pace (each chunk when the LM "
                "had sent the token completing its frames: a server adding nothing), the stalls that are the LM's "
                "(pcm).\n\n"
                + markdown_table([*server, "format", "LM pace", "arrivals", "clients", "audio s / LM requests per client",
                                  "200 / complete", "chunk gap p50 / p99 / max ms", "LM chunk gap p99 / max ms",
                                  "streams stalled (150 ms buffer) / longest ms (at the LM's pace)", "end past nominal p99 / max ms",
                                  "server CPU cores / ms per stream-second"], pace))
    beside = [r for r in rows if "lm_steps_per_s" in r]
    if beside:
        out += ("\n## Beside an LM on the same GPU\n\n"
                f"`scripts/colocated_lm.py` (a Llama-3.2-3B-shaped decode step for 64 sequences in one CUDA graph, "
                f"holding {results['args']['colocated_lm']:g} of the card) steps back to back from before the server "
                f"starts; its steps per second in each load (from 1.5 s in) "
                f"against the mean of the idle windows ({results['args']['lm_idle_s']:g} s, the server idle) before and "
                f"after it. Server GPU MiB: nvidia-smi's, summed over the server's processes after start-up (its CUDA "
                "contexts included); reserved: torch's allocator in the process that decodes. Late pushes: the server's count of pushes whose "
                "audio took over one frame (85.3 ms); chunk added: each audio chunk at the client after the LM sent "
                "its last token (pcm).\n\n"
                + markdown_table(["--max-wait-ms", "--gpu-memory-gb", "MPS", "clients", "LM pace",
                                  "server GPU MiB / reserved GB", "LM steps/s idle / under load", "LM loss", "late pushes",
                                  "chunk added p99 / max ms", "chunk gap p99 / max ms"],
                                 [["serve's" if r.get("max_wait_ms") is None else f"{r['max_wait_ms']:g}",
                                   f"{r.get('gpu_memory_gb') or 0:g}", "yes" if r.get("mps") else "no",
                                   r["clients"], f"{r['pace']:g}x", _memory_cell(r.get("server_memory")),
                                   f"{r['lm_idle_steps_per_s']:.1f} / {r['lm_steps_per_s']:.1f}",
                                   f"**{100 * r['lm_loss']:.1f}%**", int(r["server_late_pushes"]),
                                   f"{r['chunk_added_p99_ms']:.1f} / {r['chunk_added_max_ms']:.1f}",
                                   f"{r['gap_p99_ms']:.1f} / {r['gap_max_ms']:.1f}"] for r in beside]))
    return out


def main() -> None:
    import json

    import httpx

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="64,256", help="loads, comma-separated")
    parser.add_argument("--arrivals", default="stagger", help="poisson, burst or stagger (comma-separated: each load each way)")
    parser.add_argument("--repeat", type=int, default=10, help="requests of the 1-client load, one after another")
    parser.add_argument("--seed", type=int, default=0, help="the Poisson arrivals' seed")
    parser.add_argument("--format", default="pcm", help="the requests' response_format, comma-separated: each load in "
                        "each (pcm: chunk delays timed too)")
    parser.add_argument("--pace", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=20.0, help="audio per request (the Poisson rate's unit)")
    parser.add_argument("--input-chars", type=int, default=0,
                        help="long input: each request this many characters of sentences (its audio from the LM's "
                        "--lm-chars-per-second, spoken in segments), not one short line of --seconds")
    parser.add_argument("--lm-chars-per-second", type=float, default=15.0,
                        help="with --input-chars or --text-ws: the fake LM's answers as long as the text at this rate")
    parser.add_argument("--text-ws", type=int, default=0, metavar="SENTENCES",
                        help="text WebSockets instead of speech requests: each sends this many sentences")
    parser.add_argument("--sentence-every", type=float, default=3.0, help="with --text-ws: seconds between sentences")
    parser.add_argument("--player-buffer-ms", type=float, default=150.0, help="the playback stalls' client buffer")
    parser.add_argument("--lookahead", default="exact", help="serve --lookahead")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--shared-engine", action="store_true", help="the workers feed one engine process (serve --shared-engine)")
    parser.add_argument("--engine-calls", choices=["auto", "loop", "thread"], default="auto",
                        help="serve --engine-calls: who runs the engine's calls")
    parser.add_argument("--max-wait-ms", type=float, default=None, help="serve --max-wait-ms (default: serve's)")
    parser.add_argument("--max-streams", type=int, default=1024, help="per worker")
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--device", default=None)
    parser.add_argument("--cpu-threads", type=int, default=0, help="serve --cpu-threads (with --device cpu)")
    parser.add_argument("--model", default="synthetic:snac_24khz",
                        help="what the server loads (a 24 kHz model: a folder of a smaller checkpoint lets a CPU keep pace)")
    parser.add_argument("--lm-workers", type=int, default=1, help="fake LM processes")
    parser.add_argument("--client-procs", type=int, default=1, help="client processes")
    parser.add_argument("--gpu-memory-gb", type=float, default=0.0, help="serve --gpu-memory-gb")
    parser.add_argument("--rows-per-pass", type=int, default=None, help="serve --rows-per-pass (default: serve's)")
    parser.add_argument("--memory-trim", type=float, default=None, help="serve --memory-trim (default: serve's)")
    parser.add_argument("--ws-compression", action="store_true", help="serve --ws-compression: accept the text "
                        "WebSockets' clients' offer of permessage-deflate (the websockets library and browsers offer it)")
    parser.add_argument("--colocated-lm", type=float, default=0.0, metavar="SHARE",
                        help="run scripts/colocated_lm.py first, holding this share of the GPU (0.9 as vLLM's default), "
                             "and measure its steps per second in each load and in idle windows between")
    parser.add_argument("--lm-idle-s", type=float, default=8.0, help="with --colocated-lm: each idle window")
    parser.add_argument("--mps", action="store_true", help="run everything under the MPS control daemon")
    parser.add_argument("--out", default=None)
    parser.add_argument("--stem", default=None, help="output file name without extension (default: serve_http_24khz_<gpu>)")
    parser.add_argument("--append", action="store_true", help="add this run's rows to the report of the same stem")
    parser.add_argument("--profile-server", type=float, default=0.0, metavar="S",
                        help="py-spy the server (and its workers) for S seconds, --profile-delay s into each run, into --logs")
    parser.add_argument("--profile-delay", type=float, default=5.0, metavar="S",
                        help="seconds into each run before py-spy starts (0: from the first request, for the first audio)")
    parser.add_argument("--logs", default=None, help="folder for the LM's and the server's output (default: a temporary one)")
    args = parser.parse_args()
    logs = Path(args.logs or tempfile.mkdtemp(prefix="bench_serve_http_"))
    logs.mkdir(parents=True, exist_ok=True)
    frames = int(args.seconds / FRAME_S)
    mps = colocated_lm.mps_start(str(logs / "mps")) if args.mps else None
    beside, lm_steps = None, str(logs / "colocated_lm_steps.txt")
    if args.colocated_lm:  # first, as vLLM is up before the decoder: the server must fit beside it
        beside = colocated_lm.start(lm_steps, args.colocated_lm, str(logs / "colocated_lm.log"))
    lm_port, port = free_port(), free_port()
    stats_dir = tempfile.mkdtemp(prefix="fake_lm_stats_")
    length = ["--chars-per-second", f"{args.lm_chars_per_second:g}"] if args.input_chars or args.text_ws else []
    lm = start_fake_lm(lm_port, args.pace, frames, logs / "fake_lm.log", "--workers", str(args.lm_workers),
                       "--stats-dir", stats_dir, *length)
    t0 = time.monotonic()
    serve = [sys.executable, "-m", "snac_fast.cli", "serve", "--model", args.model, "--port", str(port),
             "--lm-url", f"http://127.0.0.1:{lm_port}/v1", *serve_options(args)]
    server = start(serve, f"http://127.0.0.1:{port}/health", logs / "server.log")
    print(f"server up in {time.monotonic() - t0:.1f} s; logs in {logs}", flush=True)
    command = ("python scripts/bench_serve_http.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in (("clients", args.clients), ("arrivals", args.arrivals),
                                                      ("repeat", args.repeat), ("format", args.format), ("pace", f"{args.pace:g}"),
                                                      ("seconds", f"{args.seconds:g}"), ("input_chars", args.input_chars),
                                                      ("text_ws", args.text_ws), ("sentence_every", f"{args.sentence_every:g}"),
                                                      ("lm_workers", args.lm_workers),
                                                      ("client_procs", args.client_procs))) + " " + " ".join(serve_options(args)))
    results = {"args": vars(args), "commands": [command], "server_start_s": time.monotonic() - t0, "rows": [],
               "mps": mps, "server_memory": server_memory(port, server.pid)}
    idle_windows: list[float] = []

    def idle_window() -> None:  # the LM alone (the server idle) for --lm-idle-s
        start = time.monotonic()
        time.sleep(args.lm_idle_s)
        idle_windows.append(colocated_lm.steps_per_second(lm_steps, start + 0.5, time.monotonic()))
    geometry = stream_geometry(None if args.lookahead == "exact" else args.lookahead if args.lookahead == "fp16"
                               else int(args.lookahead))
    arrivals_kinds = args.arrivals.split(",")
    # one client: its requests one after another (--repeat of them), whatever the arrivals
    loads = [(int(c), a, f) for f in args.format.split(",") for c in args.clients.split(",")
             for a in (arrivals_kinds[:1] if int(c) == 1 else arrivals_kinds)]
    try:
        for run, (clients, arrivals, fmt) in enumerate(loads):
            if args.profile_server:
                out = logs / f"server_profile_{clients}_{arrivals}.txt"
                subprocess.Popen(["bash", "-c", f"sleep {args.profile_delay:g} && py-spy record -p {server.pid} --subprocesses --threads --idle --nonblocking "
                                  f"-d {args.profile_server:g} -r 200 -f raw -o {out} > {out}.log 2>&1"])
            if beside is not None:
                idle_window()
            late0 = late_chunks(httpx.get(f"http://127.0.0.1:{port}/metrics").text)
            cpu0, wall0 = tree_cpu_by_name(server.pid), time.monotonic()
            records = []
            for k in range(args.repeat if clients == 1 else 1):
                offsets = arrival_offsets(clients, arrivals, args.seconds / args.pace, args.seed + k)
                request = {"format": fmt, "input_chars": args.input_chars,
                           "text_ws": {"sentences": args.text_ws, "every": args.sentence_every} if args.text_ws else None}
                records += all_clients(f"http://127.0.0.1:{port}", offsets, f"run{run}-{clients}-{arrivals}-{k}",
                                       args.client_procs, request)
            cpu1, wall = tree_cpu_by_name(server.pid), time.monotonic() - wall0
            by_name = {name: seconds - cpu0.get(name, 0.0) for name, seconds in cpu1.items()}
            cpu = sum(by_name.values())
            scrape = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            row = summarize(records, read_stats_dir(stats_dir), args.pace, scrape, geometry,
                            pcm=fmt == "pcm" or bool(args.text_ws), buffer_s=args.player_buffer_ms / 1e3)
            # the server's processes (workers, the engine process): CPU cores while the load ran, per stream
            row.update(clients=clients, requests=len(records), format="text-ws pcm" if args.text_ws else fmt,
                       input_chars=args.input_chars, arrivals=arrivals, pace=args.pace, lookahead=args.lookahead,
                       seconds=args.seconds, server_cpu_cores=cpu / wall, server_cpu_ms_per_stream_s=1e3 * cpu / wall / clients,
                       server_cpu_ms_per_stream_s_by_process={name: round(1e3 * seconds / wall / clients, 2)
                                                              for name, seconds in sorted(by_name.items())})
            row.update(server=server_form(args), max_wait_ms=args.max_wait_ms, gpu_memory_gb=args.gpu_memory_gb, mps=bool(mps),
                       server_memory=results["server_memory"])  # this run's, after start-up
            if beside is not None:  # the LM while every client streams (past their first audio)
                row["lm_steps_per_s"] = colocated_lm.steps_per_second(
                    lm_steps, wall0 + 1.5, min(wall0 + args.seconds / args.pace, wall0 + wall) - 0.5)
                row["server_late_pushes"] = late_chunks(scrape) - late0
            results["rows"].append(row)
            print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                   if k != "server_push_histogram"}, flush=True)
        if beside is not None:
            idle_window()
            for k, row in enumerate(results["rows"]):  # beside the idle windows before and after it
                row["lm_idle_steps_per_s"] = (idle_windows[k] + idle_windows[k + 1]) / 2
                row["lm_loss"] = 1 - row["lm_steps_per_s"] / row["lm_idle_steps_per_s"]
            results["server_memory_after"] = server_memory(port, server.pid)
    finally:
        server.terminate()
        lm.terminate()
        server.wait(60)
        lm.wait(10)
        if beside is not None:
            beside.kill()
        if mps:
            colocated_lm.mps_stop()
    try:
        import torch

        results["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        results["device"] = "unknown"
    results["date"] = time.strftime("%Y-%m-%d")
    # uvicorn (server, fake LM) and the clients run on uvloop where it is installed, as uvicorn[standard]
    # installs it for users; GPU runs before 2026-12-07's last ones had none (its wheel was not carried)
    try:
        importlib.import_module("uvloop")
        results["event_loop"] = "uvloop"
    except ImportError:
        results["event_loop"] = "asyncio"
    if args.out:
        stem = args.stem or f"serve_http_24khz_{gpu_tag(results['device'])}"
        earlier = Path(args.out) / f"{stem}.json"
        if args.append and earlier.exists():
            before = json.loads(earlier.read_text())
            results["commands"] = before["commands"] + results["commands"]
            results["rows"] = before["rows"] + results["rows"]
        write_results(Path(args.out), stem, results, markdown(results))


if __name__ == "__main__":
    main()
