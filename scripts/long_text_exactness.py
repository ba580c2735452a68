"""A long text as one speech response, every join checked: `snac-fast serve`'s app (in this process,
on uvicorn) speaks a text of about ``--minutes`` of speech through a fake LM whose answers are as long
as their segments (15 characters a second), and the response's float32 PCM is compared with the
offline decode of every segment's codes concatenated, as a whole and around each join.

    python scripts/long_text_exactness.py --minutes 10 --device cpu     # a narrow synthetic model
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from snac_fast import FastSNAC
from snac_fast.metrics import snr_db
from snac_fast.model.synthetic import synthetic_model
from snac_fast.orpheus import ORPHEUS
from snac_fast.serve import ServeSettings, create_app
from snac_fast.serve.lm.fake import FakeLM
from snac_fast.serve.lm.segments import split_text

CHARS_PER_SECOND = 15.0


@contextlib.contextmanager
def served(app):
    """``app`` on uvicorn in a thread, on an ephemeral loopback port: its base URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


def long_text(minutes: float) -> str:
    words = ("the quick brown fox jumps over a lazy dog while the river runs on past the old mill and "
             "every bird in the valley sings").split()
    rng = np.random.default_rng(0)
    sentences, length = [], 0
    while length < minutes * 60 * CHARS_PER_SECOND:
        sentence = " ".join(rng.choice(words, int(rng.integers(6, 18)))).capitalize() + rng.choice([".", "!", "?"])
        sentences.append(sentence)
        length += len(sentence) + 1
    return " ".join(sentences)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="a JSON file for the figures")
    args = parser.parse_args()
    narrow = {"decoder_dim": 256, "encoder_dim": 16} if args.device == "cpu" else {}
    codec = FastSNAC(synthetic_model("snac_24khz", **narrow), device=args.device, fuse=args.device != "cpu")
    text = long_text(args.minutes)
    lm = FakeLM(chars_per_second=CHARS_PER_SECOND, split_tokens=True)
    with served(lm.app) as lm_url:
        settings = ServeSettings.of(lm_url=lm_url + "/v1", lm_model="orpheus", max_input_chars=len(text) + 1)
        segments = split_text(text, settings.lm.segment_chars)
        with served(create_app(codec, settings)) as url:
            started = time.perf_counter()
            r = httpx.post(url + "/v1/audio/speech", timeout=None,
                           json={"input": text, "response_format": "pcm", "sample_format": "f32", "seed": 3})
            took = time.perf_counter() - started
    assert r.status_code == 200, r.text
    got = torch.from_numpy(np.frombuffer(r.content, "<f4").astype(np.float64))
    answers = [lm._random_answer(s)["ids"] for s in segments]
    whole = [ids[:len(ids) - len(ids) % 7] for ids in answers]
    codes = ORPHEUS.ids_to_codes(np.concatenate(whole))
    with torch.inference_mode():
        want = codec.decode([c.to(codec.device) for c in codes], seed=3)[0, 0].double().cpu()
    frames = [len(w) // 7 for w in whole]
    joins = np.cumsum(frames)[:-1] * 2048  # where each segment's audio begins
    around = [float(snr_db(want[j - 4096:j + 4096], got[j - 4096:j + 4096])) for j in joins]
    result = {"minutes_of_text": args.minutes, "characters": len(text), "segments": len(segments),
              "segment_chars": settings.lm.segment_chars, "audio_seconds": got.numel() / 24000,
              "samples_equal_length": got.numel() == want.numel(), "snr_db_whole": float(snr_db(want, got)),
              "snr_db_joins_min": min(around), "snr_db_joins_median": float(np.median(around)),
              "response_seconds": took, "device": args.device, "model": "synthetic snac_24khz" + (" (narrow)" if narrow else ""),
              "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
