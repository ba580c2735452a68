"""The load benchmark's reading of its records (`scripts/bench_serve_http.py`): which LM token each
pcm chunk waited on, over a stream's several LM answers, and the stalls a player would have had at
the LM's own pace, against which the server's share of a stall is told."""

import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_serve_http as bench  # noqa: E402

FRAME, LOOKAHEAD, PER_FRAME = 2048, 5124, 7  # the 24 kHz exact stream's geometry, Orpheus's 7 ids a frame
FIRST = 4  # frames before a stream's first audio: 4 * 2048 - 5124 = 3068 samples
GEOMETRY = {"frame_samples": FRAME, "lookahead": LOOKAHEAD, "per_frame": PER_FRAME, "first_frames": FIRST}


def lm_answer(start: float, frames: int, frame_s: float, rng, tail: int = 0) -> dict:
    """A fake LM's record of one answer: (time, tokens sent so far) after each chunk of 1-4 tokens,
    ``frame_s`` a frame's tokens on average."""
    sends, sent, t = [], 0, start
    while sent < frames * PER_FRAME + tail:
        chunk = min(frames * PER_FRAME + tail - sent, int(rng.integers(1, 5)))
        sent += chunk
        t += frame_s * chunk / PER_FRAME * rng.uniform(0.5, 1.5)
        sends.append((t, sent))
    return {"sends": sends}


def frame_sent_at(answers: list[dict], frame: int) -> float:
    """When the LM had sent the tokens of ``frame`` (1-based, over the answers in order), and every earlier one."""
    ready, base = -np.inf, 0
    for answer in answers:
        whole = answer["sends"][-1][1] // PER_FRAME
        for t, n in answer["sends"]:
            ready = max(ready, t)
            if base + n // PER_FRAME >= frame:
                return ready
        base += whole
    raise AssertionError("past the last frame")


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), segments=st.integers(1, 4), lag=st.floats(0.0, 0.2))
def test_each_chunk_waits_on_the_token_completing_its_frames_over_every_answer_of_the_stream(seed, segments, lag):
    rng = np.random.default_rng(seed)
    frames = [int(rng.integers(5, 12)) for _ in range(segments)]
    answers, start = [], 0.0
    for k, n in enumerate(frames):  # a later answer starts while the one before it still speaks
        answers.append(lm_answer(start, n, 0.08, rng, tail=int(rng.integers(0, PER_FRAME)) if k < segments - 1 else 0))
        start = answers[-1]["sends"][len(answers[-1]["sends"]) // 2][0]
    lm_stats = {f"text {k}": answer for k, answer in enumerate(answers)}
    total = sum(frames)
    # the server's chunks: the first audio after 4 frames, a frame's samples a chunk, then the flush's tail
    sizes = [FIRST * FRAME - LOOKAHEAD] + [FRAME] * (total - FIRST) + [LOOKAHEAD]
    due = [frame_sent_at(answers, FIRST + i) for i in range(total - FIRST + 1)]
    arrivals = np.maximum.accumulate(np.array(due) + lag * rng.random(len(due)))
    record = {"chunks": [(float(t), 2 * n) for t, n in zip([*arrivals, arrivals[-1] + 0.01], sizes)]}

    counts, times = bench.ready_times(list(lm_stats), lm_stats, PER_FRAME)
    ready = bench.chunk_ready(record, counts, times, **GEOMETRY)

    assert ready[-1] is None  # the flush's tail waits on no token
    np.testing.assert_allclose(ready[:-1], due)
    np.testing.assert_allclose(bench.chunk_delays(record, ready), arrivals - np.array(due))
    paced = bench.lm_paced(record, counts, times, **GEOMETRY)  # frame by frame, as this server sent them
    assert [n for _, n in paced["chunks"]] == [n for _, n in record["chunks"]]
    np.testing.assert_allclose([t for t, _ in paced["chunks"]], [*due, due[-1]])


def test_a_stall_of_the_server_vanishes_at_the_lm_pace_and_one_of_the_lm_stays():
    rng = np.random.default_rng(0)
    answer = lm_answer(0.0, 30, 2048 / 24000, rng)
    lm_stats = {"t": answer}
    counts, times = bench.ready_times(["t"], lm_stats, PER_FRAME)
    due = [frame_sent_at([answer], FIRST + i) for i in range(27)]
    sizes = [FIRST * FRAME - LOOKAHEAD] + [FRAME] * 26
    late = [t + (0.5 if i == 10 else 0.0) for i, t in enumerate(due)]  # the server holds one chunk 0.5 s
    record = {"chunks": [(t, 2 * n) for t, n in zip(np.maximum.accumulate(late), sizes)]}
    ready = bench.chunk_ready(record, counts, times, **GEOMETRY)

    assert bench.playback_stalls(record, 24000, 0.15) > 0.3
    assert bench.playback_stalls(bench.lm_paced(record, counts, times, **GEOMETRY), 24000, 0.15) == 0.0
    assert min(bench.chunk_delays(record, ready)) >= 0.0 and max(bench.chunk_delays(record, ready)) >= 0.5

    # a late server sends what it held as one chunk: at the LM's pace its frames still come one by one
    merged = {"chunks": record["chunks"][:10] + [(record["chunks"][20][0], sum(n for _, n in record["chunks"][10:21]))]
              + record["chunks"][21:]}
    paced = bench.lm_paced(merged, counts, times, **GEOMETRY)
    assert sum(n for _, n in paced["chunks"]) == sum(n for _, n in merged["chunks"])
    assert bench.playback_stalls(paced, 24000, 0.15) == 0.0 < bench.playback_stalls(merged, 24000, 0.15)

    slow = {"sends": [(t + (1.0 if n > 15 * PER_FRAME else 0.0), n) for t, n in answer["sends"]]}  # the LM pauses 1 s
    counts, times = bench.ready_times(["t"], {"t": slow}, PER_FRAME)
    assert bench.playback_stalls(bench.lm_paced(record, counts, times, **GEOMETRY), 24000, 0.15) > 0.5


def test_the_fake_lm_process_freezes_its_start_up_objects():
    """The fake LM as `python -m snac_fast.serve.lm.fake` builds it (its app factory) leaves its
    start-up objects out of the collector's scans, as the server's processes do: unfrozen, a full
    collection of torch's ~180k objects stalled its loop 60-140 ms, charged to the server's accept."""
    import json
    import os
    import subprocess

    from snac_fast.serve.lm.fake import ENVIRONMENT

    code = ("import gc\nfrom snac_fast.serve.lm.fake import app_from_environment\nbefore = gc.get_freeze_count()\n"
            "app_from_environment()\nprint(before, gc.get_freeze_count())")
    env = dict(os.environ, **{ENVIRONMENT: json.dumps({"pace": 1.0, "frames": 4})})
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = map(int, done.stdout.split())
    assert before == 0 and after > 50_000, (before, after)
