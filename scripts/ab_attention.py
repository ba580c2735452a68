"""A/B of the 32/44 kHz local attention in a float16 codec: HalfLocalMHA (the default) against
upstream's module kept in float32 (``fuse=False``'s path), everything else the same. Per call
with sync (CUDA graphs), interleaved rounds, medians; decode fidelity of each against float32 and
the encode codes' agreement between the two.

    python scripts/ab_attention.py --model snac_32khz [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from snac_fast import FastSNAC
from snac_fast.modules import HalfLocalMHA
from snac_fast.surgery import keep_attention_float32
from snac_fast.testing import synthetic_model


def with_float32_attention(codec: FastSNAC) -> FastSNAC:
    from snac.attention import LocalMHA

    for module in codec.model.modules():
        if type(module) is HalfLocalMHA:
            module.__class__ = LocalMHA
    keep_attention_float32(codec.model, codec.dtype)
    return codec


def call_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="snac_32khz")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    codecs = {"half attention": FastSNAC(synthetic_model(args.model), device="cuda"),
              "float32 attention": with_float32_attention(FastSNAC(synthetic_model(args.model), device="cuda"))}
    cfg = codecs["half attention"].config
    rate, strides = cfg["sampling_rate"], cfg["vq_strides"]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def codes(batch, frames):
        return [torch.randint(0, 4096, (batch, frames * strides[0] // s), device="cuda", generator=gen) for s in strides]

    hop = codecs["half attention"].model.hop_length
    frames_60s = 60 * rate // (hop * strides[0]) // 4 * 4
    work = {"decode chunk B=32": ("decode", codes(32, 4)), "decode 60 s B=1": ("decode", codes(1, frames_60s)),
            "encode 10 s B=32": ("encode", torch.randn(32, 1, 10 * rate, device="cuda", generator=gen) * 0.1)}
    times = {(m, w): [] for m in codecs for w in work}
    for name, (kind, x) in work.items():
        for codec in codecs.values():
            for _ in range(3):
                getattr(codec, kind)(x)
    for _ in range(args.rounds):
        for name, (kind, x) in work.items():
            for mode, codec in codecs.items():
                times[(mode, name)].append(call_ms(lambda: getattr(codec, kind)(x)))
    print(f"{torch.cuda.get_device_name()}, {args.model}, fp16, per call with sync, median of {args.rounds} rounds")
    for name in work:
        a, b = (statistics.median(times[(m, name)]) for m in codecs)
        print(f"  {name:18s} half {a:8.3f} ms | float32 {b:8.3f} ms | {b / a:5.2f}x")
    enc = work["encode 10 s B=32"][1][:4]
    c_half, c_f32 = (codec.encode(enc) for codec in codecs.values())
    agree = [f"{100 * (a == b).float().mean().item():.2f}" for a, b in zip(c_half, c_f32)]
    print(f"  encode codes, half vs float32 attention: {' / '.join(agree)} % equal per level")
    probe = codes(2, 32)
    for mode, codec in codecs.items():
        r = codec.check_fidelity(probe, seed=0)
        print(f"  fidelity {mode}: {r.snr_db:.2f} dB vs float32 (plain upstream fp16 {r.baseline_snr_db:.2f} dB), "
              f"log-mel {r.log_mel_distance_db:.4f} dB, passed {r.passed}")


if __name__ == "__main__":
    main()
