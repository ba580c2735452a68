"""Fidelity against lookahead: approximate streams against window decodes of the same latency (CPU).

    python scripts/lookahead_curve.py --out docs/lookahead_curve        # JSON + Markdown (+ PNG)

For each model (seeded synthetic checkpoint, Snake alphas log-uniform in 0.2-5, float64 on the CPU:
float32 agrees with it to ~120 dB, far below every figure here), one-frame pushes (a group of
frames at 32/44 kHz), SNR against the whole decode of the same codes:

- stream: ``StreamEngine(lookahead=L)``, noise gains zeroed, and with noise on (keyed, fixed seed);
- window W: a plain window decode, as Orpheus-style servers run it: at each push, decode the last W
  frames and emit the newest push's worth of audio ending L samples before the window's end (noise
  gains zeroed: a window decoder draws fresh noise each time, so with noise on it could not agree).

SNR is taken over the samples every method produced (the first windows fill up, the end is
flushed differently), the same span for all methods at one lookahead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import markdown_table  # noqa: E402

from snac_fast.configs import published_config  # noqa: E402
from snac_fast.metrics import snr_db  # noqa: E402
from snac_fast.model.noise import decode_with_keyed_noise, noise_blocks  # noqa: E402
from snac_fast.model.synthetic import synthetic_model  # noqa: E402
from snac_fast.streaming import StreamEngine  # noqa: E402

MODELS = ("snac_24khz", "snac_32khz", "snac_44khz")
NARROW = {"decoder_dim": 256, "encoder_dim": 16}
# fp16 decodes against float32 on an H100 (benchmarks/decode_*_h100.md): the preset's bar
FP16_SNR_DB = {"snac_24khz": 60.38, "snac_32khz": 59.90, "snac_44khz": 59.92}


def zero_noise_gains(model: torch.nn.Module) -> None:
    """NoiseBlocks add nothing: their 1x1 conv's weight-norm magnitude (g) set to zero."""
    with torch.no_grad():
        for block in noise_blocks(model):
            for name, p in block.linear.named_parameters():
                if name in ("weight_g", "parametrizations.weight.original0", "weight"):
                    p.zero_()


def codes_for(config: dict, frames: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    s = config["vq_strides"]
    return [torch.randint(0, config["codebook_size"], (1, frames * s[0] // k), generator=gen) for k in s]


def frames_of(codes, strides, start, stop):
    return [c[:, start * strides[0] // s:stop * strides[0] // s] for c, s in zip(codes, strides)]


def stream_audio(model, config, codes, lookahead, group, seed=1) -> tuple[torch.Tensor, int]:
    engine = StreamEngine(model, config, 1, dtype=torch.float64, lookahead=lookahead)
    slot = engine.open(seed)
    frames = codes[0].shape[1]
    pieces = [engine.advance({slot: frames_of(codes, config["vq_strides"], f, f + group)})[slot]
              for f in range(0, frames, group)]
    pieces.append(engine.advance(finish=[slot])[slot])
    return torch.cat(pieces), engine.first_audio_frames


def window_decodes(model, config, codes, window, group) -> list[tuple[int, torch.Tensor]]:
    """(first frame, audio) of every window of ``window`` frames a pushing window decoder decodes."""
    frames = codes[0].shape[1]
    return [(stop - window, decode_with_keyed_noise(model, frames_of(codes, config["vq_strides"], stop - window, stop), 0)[0, 0])
            for stop in range(window, frames + 1, group)]


def window_audio(decodes, frames, window, lookahead, group, per_frame) -> torch.Tensor | None:
    """What a window decoder emits at ``lookahead``: each push's worth of audio ending ``lookahead``
    samples before its window's end; NaN before its first full window. None if no push fits."""
    out = torch.full((frames * per_frame,), float("nan"), dtype=torch.float64)
    chunk, end = group * per_frame, window * per_frame - lookahead
    if end - chunk < 0:
        return None
    for first, audio in decodes:
        base = first * per_frame
        out[base + end - chunk:base + end] = audio[end - chunk:end]
    return out


def snr_over(reference, got, span) -> float:
    return round(snr_db(reference[span], got[span]), 2)


def measure(name: str, frames: int, lookaheads: list[int] | None, narrow: bool = False) -> dict:
    overrides = NARROW if narrow else {}
    config = {**published_config(name), **overrides}
    model = synthetic_model(name, **overrides).double()
    quiet = synthetic_model(name, **overrides).double()
    zero_noise_gains(quiet)
    exact = StreamEngine(quiet, config, 1, dtype=torch.float64)
    group, per_frame, full = exact.frames_per_group, exact.samples_per_frame, exact.lookahead_samples
    codes = codes_for(config, frames, 3)
    whole_quiet = decode_with_keyed_noise(quiet, codes, 1)[0, 0]
    whole_noisy = decode_with_keyed_noise(model, codes, 1)[0, 0]
    lookaheads = lookaheads or sorted({0, 512, 1024, 2048, 3072, 4096, 6144, 8192, full} - {x for x in [6144, 8192] if x >= full})
    longest = -(-max(lookaheads) // per_frame) + 5 * group  # windows past this measured no better
    windows = [w for w in range(group, longest + 1, group) if w <= frames // 2]
    decodes = {w: window_decodes(quiet, config, codes, w, group) for w in windows}
    rows = []
    for L in [x for x in lookaheads if x <= full]:
        quiet_stream, first = stream_audio(quiet, config, codes, L if L < full else None, group)
        noisy_stream, _ = stream_audio(model, config, codes, L if L < full else None, group)
        # the span all methods cover: after the longest window's first emission, before the end's flush
        start = max(windows) * per_frame
        stop = frames * per_frame - max(L, group * per_frame) - group * per_frame
        span = slice(start, stop)
        by_window = {}
        for w in windows:
            audio = window_audio(decodes[w], frames, w, L, group, per_frame)
            if audio is not None and not torch.isnan(audio[span]).any():
                by_window[w] = snr_over(whole_quiet, audio, span)
        best = max(by_window.items(), key=lambda kv: kv[1]) if by_window else (None, None)
        rows.append({"lookahead": L, "lookahead_ms": round(1000 * L / config["sampling_rate"], 1), "exact": L == full,
                     "first_audio_frames": first, "first_audio_ms": round(1000 * first * per_frame / config["sampling_rate"], 1),
                     "stream_db": snr_over(whole_quiet, quiet_stream, span),
                     "stream_noise_on_db": snr_over(whole_noisy, noisy_stream, span),
                     "best_window": best[0], "best_window_db": best[1], "windows_db": by_window})
        print(name, rows[-1], flush=True)
    fp16 = FP16_SNR_DB[name]
    preset = preset_search(quiet, config, codes, group, whole_quiet, rows, fp16, full)
    return {"model": name, "narrow": narrow, "frames": frames, "samples_per_frame": per_frame, "frames_per_group": group,
            "exact_lookahead": full, "fp16_snr_db": fp16, "fp16_preset_lookahead": preset, "rows": rows}


def preset_search(model, config, codes, group, whole, rows, floor_db, full, step=128) -> int:
    """The least lookahead (to ``step`` samples) whose stream beats ``floor_db`` over the whole
    output: bisection between the grid's lookaheads that bracket it (stream only, noise gains zeroed)."""
    above = [r["lookahead"] for r in rows if r["stream_db"] >= floor_db]
    below = [r["lookahead"] for r in rows if r["stream_db"] < floor_db]
    hi = min(above) if above else full
    lo = max([x for x in below if x < hi], default=-1)
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        audio, _ = stream_audio(model, config, codes, mid, group)
        db = snr_db(whole, audio)
        print(f"  preset search: lookahead {mid}: {db:.2f} dB", flush=True)
        lo, hi = (lo, mid) if db >= floor_db else (mid, hi)
    return hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--frames", type=int, default=48, help="coarse frames decoded per model")
    ap.add_argument("--lookaheads", type=int, nargs="*")
    ap.add_argument("--narrow", action="store_true", help=f"decoder and encoder narrowed to {NARROW} (same geometry; faster)")
    ap.add_argument("--out", type=Path, default=Path("docs/lookahead_curve"))
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    write_outputs([measure(m, args.frames, args.lookaheads, args.narrow) for m in args.models], args.out)


def write_outputs(results: list[dict], out: Path) -> None:
    """``out``.json, .md (a table per model) and .png (SNR against lookahead), beside each other."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    md = []
    for r in results:
        md.append(f"**{r['model']}**{' (narrowed)' if r['narrow'] else ''} ({r['samples_per_frame']} samples a frame, pushes of {r['frames_per_group']} "
                  f"frame(s), exact lookahead {r['exact_lookahead']}; fp16 decode vs float32: {r['fp16_snr_db']} dB, "
                  f"reached from lookahead {r['fp16_preset_lookahead']})\n")
        md.append(markdown_table(
            ["lookahead samples", "ms", "first audio after (frames / ms)", "stream dB", "stream, noise on dB",
             "best window decode dB (frames)"],
            [[str(x["lookahead"]) + (" (exact)" if x["exact"] else ""), x["lookahead_ms"],
              f"{x['first_audio_frames']} / {x['first_audio_ms']}", x["stream_db"], x["stream_noise_on_db"],
              "—" if x["best_window"] is None else f"{x['best_window_db']} ({x['best_window']})"] for x in r["rows"]]))
        md.append("")
    out.with_suffix(".md").write_text("\n".join(md))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), squeeze=False)
    for ax, r in zip(axes[0], results):
        xs = [x["lookahead"] for x in r["rows"]]
        ax.plot(xs, [x["stream_db"] for x in r["rows"]], "o-", label="stream")
        ax.plot(xs, [x["best_window_db"] for x in r["rows"]], "s--", label="best window decode")
        ax.axhline(r["fp16_snr_db"], color="gray", lw=0.8, label="fp16 decode")
        ax.set(title=r["model"], xlabel="lookahead (samples)", ylabel="SNR vs whole decode (dB)", ylim=(0, 140))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
