"""A/B of the NoiseBlock GEMM's input bias (the deferred bias of the cuDNN transposed conv before
it): this tree folds it (``bias + W @ ib`` in the GEMM's bias, ib added to the residual) against an
older ``ops/pointwise.py`` (``--against``) that added ib to every h tile inside the K loop. Float16,
synthetic seeded weights, one process:

1. each NoiseBlock GEMM call of real decodes (recorded), timed alone (a CUDA graph of 20 calls):
   the old kernel at its tiles (128 x 64 for inputs over 128 channels), the folded one at the same
   tiles, the folded one at this tree's rule;
2. whole decodes with CUDA graphs (chunk B=1 and B=32, 5 s, 60 s), old NoiseBlocks against this
   tree's: per call with sync and GPU, interleaved rounds, medians, and the SNR between the two;
3. stream-engine steps (24 kHz), 1 and 64 streams: per call with sync and the replay alone.

    git show REV:snac_fast/ops/pointwise.py > old_pointwise.py
    python scripts/experiments/ab_noise_fold.py --against old_pointwise.py [--models snac_24khz ...] [--rounds 10]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/, for bench_common
from bench_common import interleaved_decodes, median_ms, timed_call  # noqa: E402

from snac_fast import FastSNAC  # noqa: E402
from snac_fast.modules import FusedNoiseBlock  # noqa: E402
from snac_fast.ops import pointwise  # noqa: E402
from snac_fast.ops.common import is_channels_last  # noqa: E402
from snac_fast.synthetic import synthetic_model  # noqa: E402


def load_module(path: str, name: str = "snac_fast.ops.pointwise_against"):
    """An older ops module (default: pointwise) loaded as ``name``, its torch.library ops renamed (one
    name registers once)."""
    module = types.ModuleType(name)
    module.__file__ = path
    source = Path(path).read_text().replace('"snac_fast::', '"snac_fast_against::')
    exec(compile(source, path, "exec"), module.__dict__)
    return module


def old_forward(old):
    def forward(self, x):
        args = (x, self.linear.weight, self.linear.bias, x, self.draw_noise(x), self.input_bias(x))
        if self._snake_pair is not None:
            return old.pointwise_conv_pair(*args, alpha=self._snake_pair.alpha)
        return old.pointwise_conv(*args)
    return forward


def workloads(codec) -> dict[str, tuple[int, int]]:
    """label -> (batch, coarse frames): whole groups of 4 frames (the 32/44 kHz attention windows)."""
    per_group = 4 * codec.hop_length * codec.config["vq_strides"][0]
    return {"chunk B=1": (1, 4), "chunk B=32": (32, 4), "5 s": (1, 4 * math.ceil(5 * codec.sampling_rate / per_group)),
            "60 s": (1, 4 * math.ceil(60 * codec.sampling_rate / per_group))}


def codes_for(codec, batch, frames, gen):
    strides = codec.config["vq_strides"]
    return [torch.randint(0, codec.config["codebook_size"], (batch, frames * strides[0] // s), device="cuda",
                          generator=gen) for s in strides]


def graph_us(fn, calls: int = 20) -> float:
    """Median GPU µs of one call, from a CUDA graph of ``calls`` back-to-back calls."""
    return median_ms(fn, [()] * calls, replays=20) * 1e3


def per_call_kernels(name, old, gen) -> None:
    """Part 1: every NoiseBlock GEMM call with an input bias in eager decodes of each workload."""
    codec = FastSNAC(synthetic_model(name), device="cuda", cuda_graphs=False)
    calls = {}
    real = pointwise._pointwise_conv_triton

    def record(h, weight, bias, residual, scale, residual_bias, *rest, **kw):
        if residual_bias is not None:
            calls.setdefault((tuple(h.shape), is_channels_last(h), rest[3] is not None), (weight, residual_bias, rest[1]))
        return real(h, weight, bias, residual, scale, residual_bias, *rest, **kw)

    pointwise._pointwise_conv_triton = record
    try:
        for label, (batch, frames) in workloads(codec).items():
            with torch.inference_mode():
                codec.decode(codes_for(codec, batch, frames, gen), seed=0)
    finally:
        pointwise._pointwise_conv_triton = real
    for (shape, channels_last, pair), (w, ib, alpha) in calls.items():
        B, C, T = shape
        h = torch.randn(B, T, C, device="cuda", dtype=torch.float16).transpose(1, 2)
        if not channels_last:
            h = h.contiguous()
        scale = torch.randn(B, 1, T, device="cuda", dtype=torch.float16)
        out, pair_out = torch.empty(B, C, T, device="cuda", dtype=torch.float16), torch.empty(B, C, T, device="cuda", dtype=torch.float16)
        pair_out = pair_out if pair else None
        alpha = alpha if pair else None
        folded = pointwise.fold_input_bias(w, None, ib)
        old_tiles = old._pw_config(B, C, C, T, h.device, True)
        rule = pointwise._pw_config(B, C, C, T, h.device)
        results = {
            f"old {old_tiles[:3]}": graph_us(lambda: old._pointwise_conv_triton(h, w, None, h, scale, ib, None, out, alpha, pair_out)),
            f"folded {old_tiles[:3]}": graph_us(lambda: pointwise._pointwise_conv_triton(h, w, folded, h, scale, ib, None, out, alpha,
                                                                                     pair_out, config=old_tiles)),
            f"folded, rule {rule[:3]}": graph_us(lambda: pointwise._pointwise_conv_triton(h, w, folded, h, scale, ib, None, out,
                                                                                         alpha, pair_out, config=rule)),
        }
        moved = 3 * h.numel() * 2 if pair else 2 * h.numel() * 2
        print(f"  {name} NoiseBlock GEMM B={B} C={C} T={T} {'[B,T,C]' if channels_last else '[B,C,T]'}"
              f"{' pair' if pair else ''}: " + " | ".join(f"{k} {v:.1f} us" for k, v in results.items())
              + f" | HBM floor at 3.35 TB/s {moved / 3.35e6:.1f} us", flush=True)


def whole_decodes(name, old, rounds, gen) -> None:
    """Part 2: two codecs, graphs captured per mode."""
    codecs = {mode: FastSNAC(synthetic_model(name), device="cuda") for mode in ("old", "folded")}
    for module in codecs["old"].model.modules():
        if isinstance(module, FusedNoiseBlock):
            module.forward = types.MethodType(old_forward(old), module)
    work = {label: codes_for(codecs["old"], b, f, gen) for label, (b, f) in workloads(codecs["old"]).items()}
    for codec in codecs.values():
        for codes in work.values():
            codec.decode(codes, seed=0)
    medians = interleaved_decodes(codecs, work, rounds)
    for label, codes in work.items():
        ms = {m: medians[(m, label)][0] for m in codecs}
        gpu = {m: medians[(m, label)][1] for m in codecs}
        a = codecs["old"].decode(codes, seed=0).double()
        b = codecs["folded"].decode(codes, seed=0).double()
        snr = 10 * torch.log10(a.square().sum() / (a - b).square().sum()).item()
        print(f"  {name} decode {label}: per call " + " | ".join(f"{m} {v:.3f}" for m, v in ms.items())
              + " ms; GPU " + " | ".join(f"{m} {v:.3f}" for m, v in gpu.items())
              + f" ms; folded vs old {snr:.1f} dB SNR", flush=True)
    return codecs


def stream_steps(codecs, rounds, gen, setup=None) -> None:
    """Part 3: steady one-frame steps of engines on each codec of ``codecs`` (mode -> codec; here
    the old and the folded one). ``setup(mode)``: called before a mode's engine is made and stepped."""
    for S in (1, 64):
        runs = {}
        for mode, codec in codecs.items():
            if setup is not None:
                setup(mode)
            engine = codec.stream_engine(max_streams=64)
            strides = codec.config["vq_strides"]
            total = engine.prefill_frames + rounds * 5 + 20
            codes = [c.cpu() for c in codes_for(codec, S, total, gen)]
            slots = [engine.open(seed=i) for i in range(S)]
            engine.step(slots, [c[:, :engine.prefill_frames * strides[0] // s] for c, s in zip(codes, strides)])
            steps = iter([[c[:, f * strides[0] // s:(f + 1) * strides[0] // s] for c, s in zip(codes, strides)]
                          for f in range(engine.prefill_frames, total)])
            for _ in range(3):
                engine.step(slots, next(steps))
            runs[mode] = (engine, slots, steps, [], [])
        for r in range(rounds * 5):
            for mode, (engine, slots, steps, call, replay) in runs.items():
                call.append(timed_call(engine.step, slots, next(steps))[0])
        for _ in range(rounds * 5):
            for mode, (engine, slots, steps, call, replay) in runs.items():
                graph = engine._graphs[("step", engine._bucket(S), 1)].graph
                replay.append(timed_call(graph.replay)[1])
        print(f"  stream step, {S} streams: " + " | ".join(
            f"{mode} call {statistics.median(call):.3f} ms, replay {statistics.median(replay):.3f} ms"
            for mode, (engine, slots, steps, call, replay) in runs.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="an older snac_fast/ops/pointwise.py")
    parser.add_argument("--models", nargs="+", default=["snac_24khz", "snac_32khz", "snac_44khz"])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    old = load_module(args.against)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, float16, synthetic weights", flush=True)
    for name in args.models:
        per_call_kernels(name, old, gen)
        codecs = whole_decodes(name, old, args.rounds, gen)
        if name == "snac_24khz":
            stream_steps(codecs, args.rounds, gen)
        del codecs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
