"""A/B of the 32/44 kHz local attention in a float16 codec: HalfLocalMHA (the default: the fused
window-attention kernel, the output projection with the residual in its epilogue) against the same
module on torch ops (rotation, SDPA, GEMMs and add: its path before the kernel) and against
upstream's module kept in float32 (``fuse=False``'s path), everything else the same. Per call
with sync (CUDA graphs), interleaved rounds, medians; decode fidelity of each against float32 and
the encode codes' agreement with the default.

    python scripts/experiments/ab_attention.py --model snac_32khz [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from snac_fast import FastSNAC
from snac_fast.modules import FusedConvTranspose1d, HalfLocalMHA
from snac_fast.ops.attention import local_attention_reference
from snac_fast.surgery import keep_attention_float32
from snac_fast.synthetic import synthetic_model


class TorchHalfLocalMHA(HalfLocalMHA):
    """HalfLocalMHA on torch ops: the window attention as rotation + SDPA, the output projection
    and residual add as two launches."""

    def forward(self, x):
        B, C, T = x.shape
        h = F.layer_norm(x.transpose(1, 2), (C,), self.norm.weight, self.norm.bias, self.norm.eps)
        cos, sin = self._rotary_table(self.window_size, C // self.heads, x.device)
        out = local_attention_reference(F.linear(h, self.to_qkv.weight), self.heads, self.window_size, cos, sin)
        return F.linear(out, self.to_out.weight).transpose(1, 2) + x


def give_snake_back(codec: FastSNAC) -> None:
    """The decoder's attention leaves the next block's snake to its transposed conv again."""
    seq = codec.model.decoder.model
    for layer, after in zip(seq, seq[1:]):
        if type(layer) is HalfLocalMHA and layer._snake_out is not None:
            conv = next(m for m in after.block if isinstance(m, FusedConvTranspose1d))
            conv.absorb_previous_snake(layer._snake_out)
            layer._snake_out, layer.channels_last_out = None, False


def with_torch_attention(codec: FastSNAC) -> FastSNAC:
    give_snake_back(codec)
    for module in codec.model.modules():
        if type(module) is HalfLocalMHA:
            module.__class__ = TorchHalfLocalMHA
    return codec


def with_float32_attention(codec: FastSNAC) -> FastSNAC:
    from snac.attention import LocalMHA

    give_snake_back(codec)
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
    codecs = {"fused": FastSNAC(synthetic_model(args.model), device="cuda"),
              "torch half": with_torch_attention(FastSNAC(synthetic_model(args.model), device="cuda")),
              "float32": with_float32_attention(FastSNAC(synthetic_model(args.model), device="cuda"))}
    cfg = codecs["fused"].config
    rate, strides = cfg["sampling_rate"], cfg["vq_strides"]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def codes(batch, frames):
        return [torch.randint(0, 4096, (batch, frames * strides[0] // s), device="cuda", generator=gen) for s in strides]

    hop = codecs["fused"].model.hop_length
    frames_60s = 60 * rate // (hop * strides[0]) // 4 * 4
    work = {"decode chunk B=1": ("decode", codes(1, 4)), "decode chunk B=32": ("decode", codes(32, 4)), "decode 60 s B=1": ("decode", codes(1, frames_60s)),
            "encode 10 s B=32": ("encode", torch.randn(32, 1, 10 * rate, device="cuda", generator=gen) * 0.1)}
    times = {(m, w): [] for m in codecs for w in work}
    for name, (kind, x) in work.items():
        for codec in codecs.values():
            for _ in range(3):
                getattr(codec, kind)(x)
    for r in range(args.rounds):
        for name, (kind, x) in work.items():
            for mode in list(codecs)[::1 if r % 2 == 0 else -1]:  # alternate who runs first
                run = getattr(codecs[mode], kind)
                calls = 10 if "chunk" in name else 1
                if calls > 1:  # the mode before left the caches cold: one untimed call, then several
                    run(x)
                for _ in range(calls):
                    times[(mode, name)].append(call_ms(lambda: run(x)))
    print(f"{torch.cuda.get_device_name()}, {args.model}, fp16, per call with sync, median over {args.rounds} rounds "
          "(chunks: 10 calls a round), "
          "ms (the default's speed-up over each other mode)")
    for name in work:
        ms = {m: statistics.median(times[(m, name)]) for m in codecs}
        print(f"  {name:18s} " + " | ".join(f"{m} {t:8.3f}" + (f" ({t / ms['fused']:.2f}x)" if m != "fused" else "")
                                          for m, t in ms.items()))
    enc = work["encode 10 s B=32"][1][:4]
    codes_of = {m: codec.encode(enc) for m, codec in codecs.items()}
    for mode in ("torch half", "float32"):
        agree = [f"{100 * (a == b).float().mean().item():.2f}" for a, b in zip(codes_of["fused"], codes_of[mode])]
        print(f"  encode codes, fused vs {mode}: {' / '.join(agree)} % equal per level")
    probe = codes(2, 32)
    for mode, codec in codecs.items():
        r = codec.check_fidelity(probe, seed=0)
        print(f"  fidelity {mode}: {r.snr_db:.2f} dB vs float32 (plain upstream fp16 {r.baseline_snr_db:.2f} dB), "
              f"log-mel {r.log_mel_distance_db:.4f} dB, passed {r.passed}")


if __name__ == "__main__":
    main()
