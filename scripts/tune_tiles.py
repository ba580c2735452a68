"""Sweep launch tiles of the decoder kernels at a published decoder's layer shapes (24, 32 or 44
kHz); print the best configs against the current default (what the launch rules in snac_fast/ops
were set from).

    python scripts/tune_tiles.py --batch 1 32 --frames 4 --only convt pw dw tanh
    python scripts/tune_tiles.py --model snac_32khz --batch 1 32 --frames 4 --only pw dw
    python scripts/tune_tiles.py --batch 1 --frames 704 --only pw-order   # 60 s at 24 kHz
    python scripts/tune_tiles.py --only pw-calls --json pw_calls.json     # every model and workload
    python scripts/tune_tiles.py --only dw-calls --models snac_24khz --json dw_calls.json

``pw-calls`` records the 1x1-conv GEMM calls (shapes, layouts, epilogues) of real decodes, stream
steps and encodes of all three models, then times each distinct call at every candidate tile: the
data the one launch rule in ``ops/pointwise.py`` is checked against; ``dw-calls`` does the same for
the depthwise kernel (``ops/depthwise.py``).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import median_ms  # noqa: E402

from snac_fast.configs import published_config  # noqa: E402
from snac_fast.ops import conv_tanh as tanh_ops  # noqa: E402
from snac_fast.ops import depthwise as dw_ops  # noqa: E402
from snac_fast.ops import pointwise as pw_ops  # noqa: E402
from snac_fast.ops import conv_transpose as ct  # noqa: E402

DEV, DT = "cuda", torch.float16


def rnd(*s):
    return torch.randn(*s, device=DEV, dtype=DT)


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def timed(fn, x) -> float:
    """Per-call GPU time (ms) of fn(x); small problems run many calls in one graph, since a single
    small kernel would time the graph launch."""
    calls = max(1, min(20, (1 << 23) // x.numel()))
    return median_ms(fn, [(x,)] * calls, replays=10)


def sweep(what, default_fn, fn, cfgs, x):
    default = timed(default_fn, x)
    results = []
    for cfg in cfgs:
        try:
            results.append((timed(lambda x: fn(x, cfg), x), cfg))
        except triton.runtime.errors.OutOfResources:  # too much shared memory for this tile
            pass
    results.sort()
    best = ", ".join(f"{t * 1e3:.1f}us {c}" for t, c in results[:4])
    print(f"  {what}: default {default * 1e3:.1f}us | best {best}", flush=True)


def pw_into(h, w, b, res, alpha, cfg):
    """A residual unit's tail when there is a residual (the pair: output and next snake), else a plain 1x1 conv."""
    out = torch.empty((h.shape[0], w.shape[0], h.shape[2]), device=DEV, dtype=DT)
    pair = None if res is None else torch.empty_like(out)
    pw_ops._pointwise_conv_triton(h, w, b, res, None, None, None, out, alpha if pair is not None else None, pair, config=cfg)
    return out


def sweep_pw(shapes, batches):
    cfgs = [(bm, bn, bk, w, 3) for bm, bn in itertools.product((16, 32, 64, 128), (16, 32, 64, 128, 256))
            for bk in (32, 64, 128) for w in ((2,) if bm * bn <= 512 else (4, 8) if bm * bn >= 8192 else (4,))]
    for C_out, C_in, T in shapes:
        w, b, a = rnd(C_out, C_in, 1) / C_in**0.5, rnd(C_out), torch.rand(C_out, device=DEV) + 0.5
        for B in batches:
            h = rnd(B, C_in, T)
            res = rnd(B, C_out, T) if C_in == C_out else None
            call = lambda h, cfg=None: pw_into(h, w, b, res, a, cfg)  # noqa: E731
            sweep(f"pw C_out={C_out} C_in={C_in} T={T} B={B}", call, call,
                  [c for c in cfgs if c[2] <= C_in and c[1] <= max(16, pow2(T))], h)


PW_CANDIDATES = [(bm, bn, bk, 2 if bm * bn <= 512 else 4, 3) for bm in (16, 32, 64, 128) for bn in (16, 32, 64, 128)
                 for bk in (32, 64, 128) if bm * bn <= 8192]


def harvest_calls(workloads, module, launcher: str, key_of) -> tuple[dict, dict]:
    """Run each (label, fn) workload eagerly once with ``module.<launcher>`` patched to record its
    calls. Returns {key_of(arguments): the first such call's arguments, tensors cloned} and {label:
    Counter of call keys}."""
    calls, counts, original = {}, {}, getattr(module, launcher)
    signature = inspect.signature(original)
    for label, fn in workloads:
        seen = counts[label] = collections.Counter()

        def record(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs)
            arguments.apply_defaults()
            key = key_of(arguments.arguments)
            seen[key] += 1
            if key not in calls:
                calls[key] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in arguments.arguments.items()}
            return original(*args, **kwargs)

        setattr(module, launcher, record)
        try:
            fn()
        finally:
            setattr(module, launcher, original)
    return calls, counts


def _layout(t):
    return None if t is None else (tuple(t.shape), tuple(t.stride()))


def pw_call_key(a) -> tuple:
    return (_layout(a["h"]), tuple(a["weight"].shape), a["bias"] is not None, _layout(a["residual"]),
            a["scale"] is not None, a["residual_bias"] is not None, a["alpha_out"] is not None,
            a["pair_out"] is not None, a["out_channels_last"], str(a["h"].dtype))


def dw_call_key(a) -> tuple:
    return (tuple(a["x"].shape), tuple(a["weight"].shape), a["dilation"], a["bias"] is not None,
            a["alpha"] is not None, str(a["x"].dtype))


def workloads(models, labels=None) -> list:
    """(label, fn): decodes (4-frame chunk at B=1 and B=32, 5 s, 60 s), one-frame stream steps at 1
    and 64 streams, and encodes (10 s at B=1 and B=32) of each model, eager (no CUDA graphs); with
    ``labels``, those whose label holds one of them."""
    from snac_fast import FastSNAC

    wanted = lambda label: not labels or any(part in label for part in labels)  # noqa: E731
    out = []
    for name in models:
        codec = FastSNAC.from_pretrained(f"synthetic:{name}", cuda_graphs=False)
        cfg = codec.config
        frame_s = cfg["vq_strides"][0] * codec.hop_length / cfg["sampling_rate"]
        group = 4 if cfg.get("attn_window_size") else 1
        frames = lambda s: max(group, round(s / frame_s / group) * group)  # noqa: E731

        def codes(B, n, cfg=cfg):
            return [torch.randint(0, cfg["codebook_size"], (B, n * cfg["vq_strides"][0] // k), device=DEV)
                    for k in cfg["vq_strides"]]

        for label, B, n in (("chunk B=1", 1, 4), ("chunk B=32", 32, 4), ("5 s B=1", 1, frames(5)), ("60 s B=1", 1, frames(60))):
            if wanted(label := f"{name} decode {label}"):
                out.append((label, lambda codec=codec, c=codes(B, n): codec.decode(c, seed=0)))
        for B in (1, 32):
            if wanted(label := f"{name} encode 10 s B={B}"):
                audio = torch.randn(B, 1, 10 * cfg["sampling_rate"], device=DEV, dtype=DT) * 0.1
                out.append((label, lambda codec=codec, a=audio: codec.encode(a, cuda_graphs=False)))
        for S in (1, 64):
            if wanted(label := f"{name} stream step {S} streams"):  # engines prefilled only where wanted
                engine = codec.stream_engine(S, cuda_graphs=False)
                slots = [engine.open(seed=i) for i in range(S)]
                pre = codes(S, engine.prefill_frames)
                engine.advance({s: [c[i] for c in pre] for i, s in enumerate(slots)})
                step = codes(S, group)
                out.append((label, lambda e=engine, sl=slots, c=step: e.step(sl, [x.cpu() for x in c])))
    return out


def sweep_calls(name: str, calls: dict, counts: dict, launch, candidates_of, default_of, describe,
                json_path: str | None, **json_extra) -> None:
    """Time each recorded call at its default tile and at each of ``candidates_of(args)``; print each
    call's best and each workload's total, and write every timing to ``json_path``.
    ``launch(args, cfg)``: the call as a function of its first argument (the timed input)."""
    from snac_fast.runtime.compiling import compiling_concurrently

    first = lambda args: next(iter(args.values()))  # noqa: E731
    with compiling_concurrently():  # every (call, tile) variant at once, on a process pool
        for args in calls.values():
            for cfg in [None] + candidates_of(args):
                launch(args, cfg)(first(args))
    rows = []
    for key, args in calls.items():
        times = {"default": timed(launch(args, None), first(args)) * 1e3}
        for cfg in candidates_of(args):
            try:
                times[str(cfg)] = timed(launch(args, cfg), first(args)) * 1e3
            except triton.runtime.errors.OutOfResources:  # too much shared memory for this tile
                pass
        best, default, shape = min((t, c) for c, t in times.items()), default_of(args), describe(args)
        rows.append({**shape, "key": repr(key), "default": list(default), "us": {c: round(t, 2) for c, t in times.items()},
                     "calls": {label: c[key] for label, c in counts.items() if key in c}})
        print(f"  {' '.join(f'{k}={v}' for k, v in shape.items())}: default {default} {times['default']:.1f}us"
              f" | best {best[1]} {best[0]:.1f}us", flush=True)
    for label in counts:
        total = lambda pick: sum(r["calls"][label] * pick(r) for r in rows if label in r["calls"])  # noqa: E731
        print(f"  {label}: {name} at the default {total(lambda r: r['us']['default']):.1f}us, at each call's best "
              f"{total(lambda r: min(r['us'].values())):.1f}us", flush=True)
    if json_path:
        from bench_common import environment

        Path(json_path).write_text(json.dumps({"environment": environment(), **json_extra, "rows": rows}))


def pw_calls(models, json_path: str | None, labels=None) -> None:
    """Every distinct recorded 1x1-conv GEMM call at its default tile and at each candidate that fits."""
    calls, counts = harvest_calls(workloads(models, labels), pw_ops, "_pointwise_conv_triton", pw_call_key)
    print(f"{len(calls)} distinct 1x1-conv calls over {len(counts)} workloads", flush=True)

    def launch(args, cfg):
        return lambda h: pw_ops._pointwise_conv_triton(**{**args, "h": h, "config": cfg, "rows_fastest": None})

    def candidates(args):  # no tile dimension past the problem's (rounded up to 16)
        (_, C_in, T), C_out = args["h"].shape, args["weight"].shape[0]
        return [cfg for cfg in PW_CANDIDATES
                if cfg[0] <= max(16, pow2(C_out)) and cfg[1] <= max(16, pow2(T)) and cfg[2] <= max(16, pow2(C_in))]

    def default_of(args):
        B, C_in, T = args["h"].shape
        return pw_ops._pw_config(B, args["weight"].shape[0], C_in, T, args["h"].device)

    def describe(args):
        B, C_in, T = args["h"].shape
        return {"B": B, "C_out": args["weight"].shape[0], "C_in": C_in, "T": T}

    sweep_calls("GEMMs", calls, counts, launch, candidates, default_of, describe, json_path, candidates=PW_CANDIDATES)


def dw_calls(models, json_path: str | None, labels=None) -> None:
    """Every distinct recorded depthwise call at its default tile and at each candidate."""
    calls, counts = harvest_calls(workloads(models, labels), dw_ops, "_depthwise_conv_snake_triton", dw_call_key)
    print(f"{len(calls)} distinct depthwise calls over {len(counts)} workloads", flush=True)

    def launch(args, cfg):
        return lambda x: dw_ops._depthwise_conv_snake_triton(**{**args, "x": x, "config": cfg})

    def candidates(args):
        B, C, T = args["x"].shape
        return dw_configs(T, pow2(B * C))

    def default_of(args):
        B, C, T = args["x"].shape
        return dw_ops._dw_config(B * C, T, (args["weight"].shape[-1] - 1) // 2 * args["dilation"], args["x"].device)

    def describe(args):
        B, C, T = args["x"].shape
        return {"B": B, "C": C, "T": T, "dilation": args["dilation"]}

    sweep_calls("depthwise", calls, counts, launch, candidates, default_of, describe, json_path)


def pw_order(shapes, batches):
    """The GEMM's program order at its default tiles: output-channel blocks fastest (the programs of
    one time tile together, sharing its input columns through L2) against time tiles fastest."""
    for C, T in shapes:
        w, b, a = rnd(C, C, 1) / C**0.5, rnd(C), torch.rand(C, device=DEV) + 0.5
        for B in batches:
            h, res = rnd(B, C, T), rnd(B, C, T)
            out, pair = torch.empty_like(h), torch.empty_like(h)
            cfg = pw_ops._pw_config(B, C, C, T, h.device)
            times = {order: timed(lambda h, rows=rows: pw_ops._pointwise_conv_triton(
                h, w, b, res, None, None, None, out, a, pair, config=cfg, rows_fastest=rows), h) * 1e3
                for order, rows in (("time tiles fastest", False), ("channel blocks fastest", True))}
            print(f"  pw order C={C} T={T} B={B} {cfg}: " + ", ".join(f"{k} {v:.1f}us" for k, v in times.items()), flush=True)


def dw_configs(T: int, rows_max: int) -> list[tuple[int, int, int, int]]:
    """(ROWS, BLOCK_T, num_warps, RUN): per-tap loads (RUN 0), or runs of RUN aligned chunks of 8
    for T % 8 == 0, at 8 to 32 outputs per thread."""
    cfgs = set()
    for elems, bt, w, run in itertools.product((256, 512, 1024, 2048, 4096), (16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
                                               (1, 2, 4, 8), (0, 1, 2)):
        per_thread = elems // (32 * w)
        fits = per_thread >= 4 if run == 0 else T % 8 == 0 and bt % (8 * run) == 0 and 8 * run <= per_thread <= 32
        if bt <= min(elems, max(16, pow2(T))) and elems // bt <= rows_max and fits:
            cfgs.add((elems // bt, bt, w, run))
    return sorted(cfgs)


def sweep_dw(shapes, batches):
    for C, T in shapes:
        wt, b, a = rnd(C, 1, 7) * 0.3, rnd(C), torch.rand(C, device=DEV) + 0.5
        for B, dilation in itertools.product(batches, (1, 3, 9)):
            x = rnd(B, C, T)
            call = lambda x, cfg=None: dw_ops._depthwise_conv_snake_triton(x, wt, b, dilation, a, cfg)  # noqa: E731
            sweep(f"dw C={C} T={T} B={B} dilation={dilation}", call, call, dw_configs(T, pow2(B * C)), x)


def channels_last(x):
    """x [B, C, T] laid out [B, T, C]: what the decoder feeds its transposed convs."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def cudnn_channels_last(x, w, s):
    """cuDNN's transposed conv on channels-last memory, no bias (FusedConvTranspose1d's cuDNN path)."""
    pad, opad = ct.upsampling_padding(s)
    w4 = w.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    return lambda x: F.conv_transpose2d(x.unsqueeze(2), w4, None, (1, s), (0, pad), (0, opad))


def sweep_convt(shapes, batches):
    for C_in, C_out, s, T_in in shapes:
        P = pow2(s)
        wt = rnd(C_in, C_out, 2 * s) / C_in**0.5
        bias = rnd(C_out)
        packed = ct.pack_phase_weight(wt, s)
        split = ct.splits_phases(s)
        cfgs = [(rows // P, bj, bk, w, st) for rows in (16, 32, 64, 128, 256) for bj in (16, 32, 64, 128)
                for bk in (32, 64, 128) for w in (4, 8) for st in (3,)
                if rows >= P and (not split or rows >= 32) and rows * bj <= 32768]
        for B in batches:
            x = channels_last(rnd(B, C_in, T_in))
            cudnn = timed(cudnn_channels_last(x, wt, s), x)
            call = lambda x, cfg=None: ct._conv_transpose_triton(x, packed, bias, s, cfg)  # noqa: E731
            sweep(f"convT C_in={C_in} C_out={C_out} s={s} T_in={T_in} B={B} (cuDNN no bias {cudnn * 1e3:.1f}us)",
                  call, call, [c for c in cfgs if c[1] <= max(16, pow2(T_in))], x)


def convt_paths(shapes, batches):
    """The Triton kernel with its default tiles against cuDNN (no bias), both on channels-last input
    (cuDNN also on [B, C, T] memory, where it adds layout transforms): where each path wins."""
    for C_in, C_out, s, T_in in shapes:
        wt = rnd(C_in, C_out, 2 * s) / C_in**0.5
        packed = ct.pack_phase_weight(wt, s)
        pad, opad = ct.upsampling_padding(s)
        for B in batches:
            x = rnd(B, C_in, T_in)
            x_cl = channels_last(x)
            ours = timed(lambda x: ct._conv_transpose_triton(x, packed, None, s), x_cl)
            cudnn = timed(cudnn_channels_last(x_cl, wt, s), x_cl)
            cudnn_ncl = timed(lambda x: F.conv_transpose1d(x, wt, None, s, pad, opad), x)
            print(f"  convT C_in={C_in} s={s} T_in={T_in} B={B} out {B * C_out * T_in * s / 1e6:.2f} M: "
                  f"triton {ours * 1e3:.1f}us, cuDNN channels-last {cudnn * 1e3:.1f}us, [B, C, T] {cudnn_ncl * 1e3:.1f}us",
                  flush=True)


def sweep_tanh(shapes, batches):
    cfgs = [(bc, bt, w) for bc in (16, 32, 64) for bt in (32, 64, 128, 256, 512) for w in (2, 4, 8)
            if 2048 <= bc * bt <= 8192]
    for C, T in shapes:
        w, b = rnd(1, C, 7) / C**0.5, rnd(1)
        for B in batches:
            x = rnd(B, C, T)
            call = lambda x, cfg=None: tanh_ops._conv_tanh_triton(x, w, b, cfg)  # noqa: E731
            taps = ", ".join(f"{timed(lambda x: tanh_ops._conv_tanh_by_taps(x, w, b, bt), x) * 1e3:.1f}us ({bt})"
                             for bt in (64, 128, 256, 512))
            sweep(f"conv_tanh C={C} T={T} B={B} (tap GEMM by BLOCK_T: {taps})", call, call, cfgs, x)


def decoder_shapes(name: str, frames: int) -> dict[str, list[tuple[int, ...]]]:
    """Each kernel's layer shapes in a decode of ``frames`` coarse frames: transposed convs (C_in,
    C_out, stride, T_in), 1x1 convs (C_out, C_in, T), depthwise convs and the output conv (C, T)."""
    cfg = published_config(name)
    latent = cfg["encoder_dim"] << len(cfg["encoder_rates"])
    widths, lengths = [cfg["decoder_dim"]], [frames * cfg["vq_strides"][0]]
    for r in cfg["decoder_rates"]:
        widths.append(widths[-1] // 2)
        lengths.append(lengths[-1] * r)
    units = list(zip(widths[1:], lengths[1:]))
    return {"convt": [(widths[i], widths[i + 1], r, lengths[i]) for i, r in enumerate(cfg["decoder_rates"])],
            "pw": [(widths[0], latent, lengths[0])] + [(c, c, t) for c, t in units],
            "units": units, "dw": [(latent, lengths[0])] + units, "tanh": units[-1:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="snac_24khz", help="whose layer shapes: snac_24khz, snac_32khz, snac_44khz")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--only", nargs="+", default=["pw", "convt", "dw", "tanh"])
    ap.add_argument("--models", nargs="+", default=["snac_24khz", "snac_32khz", "snac_44khz"], help="for pw-calls and dw-calls")
    ap.add_argument("--json", help="pw-calls, dw-calls: write every timing here")
    ap.add_argument("--labels", nargs="+", help="pw-calls, dw-calls: only the workloads whose label holds one of these")
    args = ap.parse_args()
    shapes = decoder_shapes(args.model, args.frames)
    t0 = time.time()
    for part in args.only:
        if part == "convt":
            sweep_convt(shapes["convt"], args.batch)
        elif part == "pw":
            sweep_pw(shapes["pw"], args.batch)
        elif part == "pw-calls":
            pw_calls(args.models, args.json, args.labels)
        elif part == "dw-calls":
            dw_calls(args.models, args.json, args.labels)
        elif part == "pw-order":
            pw_order(shapes["units"], args.batch)
        elif part == "dw":
            sweep_dw(shapes["dw"], args.batch)
        elif part == "convt-paths":
            convt_paths(shapes["convt"], args.batch)
        elif part == "tanh":
            sweep_tanh(shapes["tanh"], args.batch)
        print(f"[{' '.join(args.models) if part.endswith('-calls') else args.model} {part} done at {time.time() - t0:.0f}s]",
              flush=True)


if __name__ == "__main__":
    main()
