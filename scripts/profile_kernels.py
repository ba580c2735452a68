"""Where a decode's GPU time goes, kernel by kernel (torch.profiler), and graph replay vs call latency.

    python scripts/profile_kernels.py --model snac_24khz --frames 4 --batch 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from snac_fast import FastSNAC
from snac_fast.configs import published_config
from snac_fast.testing import synthetic_model


def tune_fused() -> None:
    """GPU time of the phase-GEMM transposed conv against cuDNN without its bias at the 24 kHz
    decoder's shapes (sets FusedConvTranspose1d.kernel_max_elements), of the residual unit's
    kernels against a copy, and of the output conv's launch settings."""
    import sys
    from pathlib import Path

    import torch.nn.functional as F

    from snac_fast.ops import conv as conv_ops
    from snac_fast.ops.conv_transpose import conv_transpose, pack_phase_weight
    from snac_fast.ops.snake import snake

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_common import median_ms

    dev, dt = "cuda", torch.float16
    rnd = lambda *s: torch.randn(*s, device=dev, dtype=dt)  # noqa: E731
    for frames, batch in [(4, 1), (4, 8), (4, 32), (59, 1), (704, 1)]:
        T0 = 4 * frames
        print(f"\n== n={frames} B={batch} ==")
        for C_in, C_out, stride, T_in in [(1024, 512, 8, T0), (512, 256, 8, 8 * T0), (256, 128, 4, 64 * T0),
                                          (128, 64, 2, 256 * T0)]:
            T = T_in * stride
            x, a = rnd(batch, C_out, T), torch.rand(C_out, device=dev) + 0.5
            dw, db, pw, pb = rnd(C_out, 1, 7) * 0.3, rnd(C_out), rnd(C_out, C_out, 1) / C_out**0.5, rnd(C_out)
            unit = median_ms(lambda x: conv_ops.pointwise_conv(conv_ops.depthwise_conv_snake(snake(x, a), dw, db, 9, a),
                                                               pw, pb, residual=x), [(x,)])
            copy = median_ms(lambda x: x.clone(), [(x,)])
            xi = rnd(batch, C_in, T_in)
            w = rnd(C_in, C_out, 2 * stride) / C_in**0.5
            packed = pack_phase_weight(w, stride)
            ours = median_ms(lambda x: conv_transpose(x, w, pb, stride, packed=packed), [(xi,)])
            pad, opad = stride // 2 + stride % 2, stride % 2
            cudnn = median_ms(lambda x: F.conv_transpose1d(x, w, None, stride, pad, opad), [(xi,)])
            print(f"  C={C_out:4d} T={T:8d} out {batch * C_out * T / 1e6:7.2f} M elems | residual unit "
                  f"{unit * 1e3:7.1f} us (copy {copy * 1e3:6.1f} us) | conv transpose: ours {ours * 1e3:7.1f} us, "
                  f"cuDNN {cudnn * 1e3:7.1f} us")
        x, w, b = rnd(batch, 64, 2048 * T0), rnd(1, 64, 7) / 8, rnd(1)
        res = sorted((median_ms(lambda x: conv_ops._conv_tanh_triton(x, w, b, cfg), [(x,)]), cfg)
                     for cfg in [(16, 512, 8), (32, 256, 4), (64, 128, 4), (16, 256, 4), (32, 512, 8), (64, 64, 2)])
        cudnn = median_ms(lambda x: torch.tanh(F.conv1d(x, w, b, padding=3)), [(x,)])
        print(f"  output conv + tanh: cuDNN {cudnn * 1e3:.1f} us; ours " + ", ".join(f"{t * 1e3:.1f} us {c}" for t, c in res[:4]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="snac_24khz")
    ap.add_argument("--frames", type=int, nargs="+", default=[4, 704])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--tune-fused", action="store_true", help="time the fused kernels' variants per layer shape")
    args = ap.parse_args()
    if args.tune_fused:
        tune_fused()
        return
    cfg = published_config(args.model)
    fast = FastSNAC(synthetic_model(args.model), device="cuda", cuda_graphs=False)
    graphed = FastSNAC(synthetic_model(args.model), device="cuda")
    for frames in args.frames:
        s = cfg["vq_strides"]
        codes = [torch.randint(0, 4096, (args.batch, frames * s[0] // k), device="cuda") for k in s]
        for _ in range(3):
            fast.decode(codes)
            graphed.decode(codes)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fast.decode(codes)
            torch.cuda.synchronize()
        per_kernel = defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k = per_kernel[e.name[:70]]
                k[0] += e.device_time_total / 1e3
                k[1] += 1
        busy = sum(v[0] for v in per_kernel.values())
        n = sum(v[1] for v in per_kernel.values())
        print(f"\n== {args.model} frames={frames} B={args.batch}: {n} kernels, {busy:.3f} ms GPU busy (eager fused) ==")
        for name, (ms, cnt) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"  {ms:8.3f} ms {100 * ms / busy:5.1f}%  x{cnt:<4} {name}")
        entry = graphed.graphs._cache[graphed.graphs.key(codes)]
        replay, call = [], []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            entry.graph.replay()
            b.record()
            b.synchronize()
            replay.append(a.elapsed_time(b))
            t0 = time.perf_counter()
            graphed.decode(codes)
            torch.cuda.synchronize()
            call.append((time.perf_counter() - t0) * 1e3)
        print(f"  graph replay alone {statistics.median(replay):.3f} ms; decode() call {statistics.median(call):.3f} ms")


if __name__ == "__main__":
    main()
