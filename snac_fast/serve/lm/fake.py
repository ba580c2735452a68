"""A stand-in for an Orpheus language model behind an OpenAI-compatible completions API: it answers
``POST /v1/completions`` (``stream: true``) with the ``<custom_token_N>`` text of codes scripted per
prompt text, cut into chunks at random places, at a set pace. For tests, the serving benchmark, and
trying ``snac-fast serve`` without a GPU-hungry LM:

    python -m snac_fast.serve.lm.fake --port 8000 --pace 1      # random codes for any prompt, real time

``GET /stats`` reports, per request tag (the prompt's text), when the token that completed the
first ``first_frames`` frames was sent (``time.monotonic()``, comparable across processes of one
host): the start of the time to first audio a server adds. With ``--stats-dir`` each process also
appends, per finished request, when it arrived, that time and when each chunk left with how many whole tokens sent so
far (one JSON line), from which the benchmark times every chunk of audio the server adds; with
``--workers N`` (uvicorn worker processes, for loads one Python process cannot stream) that folder is
the only full record, since ``/stats`` answers from one worker.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import time
from pathlib import Path

import numpy as np

from snac_fast.orpheus import CUSTOM_TOKEN_ID, ORPHEUS, TokenLayout
from snac_fast.serve.lm.presets import PRESETS

END_OF_SPEECH_TEXT = "<custom_token_2><custom_token_6>"  # end of speech (128258), end of AI (128262)


class FakeLM:
    """The app (:attr:`app`, Starlette) and its scripts. ``pace``: frames of audio per frame time
    (1: real time at 24 kHz, 7 tokens per 85.3 ms; 0: as fast as possible). ``frames``: the length of
    the random codes made for a prompt with no script. ``first_frames``: see :attr:`first_sent`.
    ``split_tokens``: chunks cut at any character, inside tokens too. ``stats_dir``: a folder where
    each finished request's first-frames time and chunk times are appended as a JSON line (one file
    per process). ``chars_per_second``: random answers as long as the prompt's text takes to speak
    at that rate (as a real TTS LM's), not ``frames``. ``cut_fraction``: that share of random answers
    stops mid-frame with no end of speech (chosen by the text). ``faults``: the shares of random
    answers that fail (a 500, or the stream cut half way), stall (silent for ``stall_seconds`` half
    way) and send junk (a token of the wrong slot half way), chosen by the text. ``preset``: play
    that model family (:data:`~snac_fast.serve.lm.presets.PRESETS`): a prompt that is not its form
    gets a 400, the answer is in its layout (start of speech first where the model writes it; no end
    of speech where the request stops at its text, as vLLM leaves a stop string out); ``model_name``:
    what ``GET /v1/models`` lists. :attr:`requests` keeps every request's body."""

    def __init__(self, pace: float = 0.0, frames: int = 60, frame_seconds: float = 2048 / 24000,
                 layout: TokenLayout = ORPHEUS, first_frames: int = 4, seed: int = 0, split_tokens: bool = False,
                 stats_dir: str | None = None, chars_per_second: float | None = None,
                 cut_fraction: float = 0.0, faults: tuple[float, float, float] = (0.0, 0.0, 0.0),
                 stall_seconds: float = 30.0, preset: str | None = None, model_name: str = "orpheus") -> None:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        self.pace, self.frames, self.frame_seconds, self.layout = pace, frames, frame_seconds, layout
        self.first_frames, self.seed, self.split_tokens = first_frames, seed, split_tokens
        self.chars_per_second, self.cut_fraction = chars_per_second, cut_fraction
        self.faults, self.stall_seconds = tuple(faults), stall_seconds
        self.scripts: dict[str, dict] = {}
        self.prompts: list[str] = []
        self.requests: list[dict] = []
        self.preset = PRESETS[preset] if preset is not None else None
        self.first_sent: dict[str, float] = {}  # prompt text -> when its first_frames-th frame's last token left
        self.received: dict[str, float] = {}  # prompt text -> when its request arrived
        self.finished: dict[str, float] = {}  # prompt text -> when its answer's last chunk left
        self._stats_path = None
        if stats_dir is not None:
            Path(stats_dir).mkdir(parents=True, exist_ok=True)
            self._stats_path = Path(stats_dir) / f"{os.getpid()}.jsonl"

        async def stats(request):
            return JSONResponse({"first_sent": self.first_sent})

        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model"}]})
        self.app = Starlette(routes=[Route("/v1/completions", self.completions, methods=["POST"]),
                                     Route("/v1/models", models), Route("/stats", stats)])

    def script(self, text: str, codes, bad_at: int | None = None, stop_early: bool = False,
               delay: float | None = None) -> list[int]:
        """Answer prompts of ``text`` with ``codes`` (per level [1, L_i]): ``bad_at``: a token of the
        wrong slot there; ``stop_early``: no end of speech and the last frame cut short; ``delay``:
        seconds between chunks (default: the pace's). Returns the ids it will send."""
        ids = self.layout.codes_to_ids(codes).tolist()
        if bad_at is not None:
            size = self.layout.frame_size
            ids[bad_at] = self.layout.offset + ((bad_at + 1) % size) * self.layout.codebook_size + 5
        if stop_early:
            ids = ids[:-3]
        self.scripts[text] = {"ids": ids, "end": not stop_early, "delay": delay}
        return ids

    def _random_answer(self, text: str) -> dict:
        """Random codes for ``text`` (as long as ``frames``, or as its text with ``chars_per_second``),
        cut mid-frame for ``cut_fraction`` of texts; the same text, the same answer."""
        rng = np.random.default_rng([self.seed, int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")])
        per_frame = self.layout.frame_size
        frames = self.frames if self.chars_per_second is None else \
            max(1, round(len(text) / self.chars_per_second / self.frame_seconds))
        codes = rng.integers(0, self.layout.codebook_size, (frames, per_frame))
        ids = (codes + self.layout.offset + np.arange(per_frame) * self.layout.codebook_size).reshape(-1).tolist()
        cut = rng.random() < self.cut_fraction
        fail, stall, junk = self.faults
        draw = rng.random()
        fault = "fail" if draw < fail else "stall" if draw < fail + stall else "junk" if draw < fail + stall + junk else None
        if fault == "junk":  # a token of the next slot's range where this slot's should be
            at = len(ids) // 2
            ids[at] = self.layout.offset + ((at + 1) % per_frame) * self.layout.codebook_size + 5
        return {"ids": ids[:-3] if cut else ids, "end": not cut, "delay": None, "fault": fault}

    async def completions(self, request):
        from starlette.responses import JSONResponse, StreamingResponse

        received = time.monotonic()
        body = await request.json()
        prompt = body.get("prompt", "")
        self.prompts.append(prompt)
        self.requests.append(body)
        if self.preset is None:
            text = prompt.split(": ", 1)[-1].split("<|eot_id|>")[0]
        else:
            parsed = self.preset.parse(prompt) if isinstance(prompt, str) else None
            if parsed is None:
                return JSONResponse({"error": {"message": f"the prompt is not in {self.preset.name}'s form: {prompt!r}"}},
                                    status_code=400)
            text = parsed[1]
        self.received[text] = received
        script = self.scripts.get(text) or self._random_answer(text)
        fault = script.get("fault")
        if fault == "fail" and len(text) % 2:  # half the failures at once, half after some audio
            return JSONResponse({"error": {"message": "the fake LM failed (injected)"}}, status_code=500)
        size = self.layout.frame_size
        # start of AI and start of speech first where the model writes them itself
        lead = ["<custom_token_5>", "<custom_token_1>"] if self.preset is not None and self.preset.starts_speech else []
        pieces = lead + [f"<custom_token_{i - CUSTOM_TOKEN_ID}>" for i in script["ids"]]
        text_out = "".join(pieces)
        token_ends = np.cumsum([len(piece) for piece in pieces])
        first_end = token_ends[min(len(lead) + self.first_frames * size, len(token_ends)) - 1] if len(token_ends) else 0
        token_seconds = self.frame_seconds / size / self.pace if self.pace else 0.0
        rng = random.Random(len(text_out))

        async def events():
            nonlocal fault
            start, at = time.monotonic(), 0
            sends = []  # (when a chunk left, whole tokens sent so far)
            lags = []  # how late this event loop woke from each wait: its own load, not the server's
            while at < len(text_out):
                if fault in ("fail", "stall") and at >= len(text_out) // 2:
                    if fault == "fail":
                        raise RuntimeError("the fake LM's stream cut (injected)")
                    await asyncio.sleep(self.stall_seconds)
                    fault = None
                if self.split_tokens:  # cut anywhere, tokens too: a server must join them again
                    end = min(at + rng.randint(1, 60), len(text_out))
                else:  # 1-4 whole tokens a chunk, as LM servers flush them
                    done = int(np.searchsorted(token_ends, at, side="right"))
                    end = int(token_ends[min(done + rng.randint(1, 4), len(token_ends)) - 1])
                whole = int(np.searchsorted(token_ends, end, side="right"))  # tokens complete after this chunk
                wait = script["delay"] if script["delay"] is not None else start + whole * token_seconds - time.monotonic()
                if wait > 0:
                    due = time.monotonic() + wait
                    await asyncio.sleep(wait)
                    lags.append(time.monotonic() - due)
                yield f"data: {json.dumps({'choices': [{'text': text_out[at:end], 'index': 0}]})}\n\n"
                sent = time.monotonic()
                sends.append((sent, whole))
                if at < first_end <= end:
                    self.first_sent[text] = sent
                at = end
            if self._stats_path is not None:  # one line per request
                with open(self._stats_path, "a") as f:  # noqa: ASYNC230 (a local file, once a request)
                    f.write(json.dumps({"text": text, "received": received, "first_sent": self.first_sent.get(text),
                                        "sends": sends, "lags": lags}) + "\n")
            if script["end"] and "<custom_token_2>" not in (body.get("stop") or []):
                yield f"data: {json.dumps({'choices': [{'text': END_OF_SPEECH_TEXT, 'index': 0}]})}\n\n"
            yield "data: [DONE]\n\n"
            self.finished[text] = time.monotonic()
        return StreamingResponse(events(), media_type="text/event-stream")


ENVIRONMENT = "SNAC_FAST_FAKE_LM"  # FakeLM's settings (JSON) for each uvicorn worker process


def app_from_environment():
    """uvicorn's app factory for ``python -m snac_fast.serve.lm.fake``: a FakeLM from the settings in
    ``SNAC_FAST_FAKE_LM``, the process's start-up objects frozen as a serving process's are (this
    module's imports hold ~180k objects, torch's among them: unfrozen, each full collection held the
    LM's event loop 60-100 ms, and its accept and chunks waited that long)."""
    from snac_fast.batching.batchers import freeze_startup_objects

    app = FakeLM(**json.loads(os.environ[ENVIRONMENT])).app
    freeze_startup_objects()
    return app


def read_stats_dir(stats_dir: str) -> dict[str, dict]:
    """What every worker appended to ``stats_dir``: prompt text -> {"first_sent": time, "sends":
    [(time, whole tokens sent), ...]}."""
    out = {}
    for path in Path(stats_dir).glob("*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                out[entry.pop("text")] = entry
    return out


def main() -> None:
    import argparse

    import uvicorn

    from snac_fast.serve.workers import run_workers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--pace", type=float, default=1.0, help="real-time factor (0: as fast as possible)")
    parser.add_argument("--frames", type=int, default=60, help="frames of audio per answer")
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    parser.add_argument("--stats-dir", default=None, help="folder for each worker's first-frames times")
    parser.add_argument("--chars-per-second", type=float, default=None,
                        help="answers as long as the text takes to speak at this rate (default: --frames)")
    parser.add_argument("--cut-fraction", type=float, default=0.0, help="share of answers cut mid-frame")
    parser.add_argument("--faults", default="0,0,0", help="shares of answers that fail, stall, send junk (e.g. 0.02,0.02,0.01)")
    parser.add_argument("--stall-seconds", type=float, default=30.0, help="how long a stalling answer is silent")
    parser.add_argument("--preset", choices=list(PRESETS), default=None, help="play this model family's prompt and answer")
    parser.add_argument("--model-name", default="orpheus", help="the model GET /v1/models lists")
    args = parser.parse_args()
    os.environ[ENVIRONMENT] = json.dumps({"pace": args.pace, "frames": args.frames, "stats_dir": args.stats_dir,
                                          "chars_per_second": args.chars_per_second,
                                          "cut_fraction": args.cut_fraction,
                                          "faults": [float(f) for f in args.faults.split(",")],
                                          "stall_seconds": args.stall_seconds, "preset": args.preset,
                                          "model_name": args.model_name})
    app = "snac_fast.serve.lm.fake:app_from_environment"
    if args.workers > 1:  # the server's workers: one SO_REUSEPORT socket each, so a burst is spread over them
        run_workers(app, args.host, args.port, args.workers, graceful_s=5, log_level="warning")
    else:
        uvicorn.run(app, factory=True, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
