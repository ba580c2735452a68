"""Approximate streams on the GPU (#44): the step's GPU time against the exact engine's at the
same batch (1, 16, 64, 256 streams; lookahead exact, 2048, 'fp16', 0; interleaved rounds, median),
then the fp16 stream's SNR against the float64 whole decode at each lookahead (three models, noise
gains zeroed). Results: benchmarks/stream_approximate_24khz_h100.{md,json}.

    python scripts/experiments/lookahead_step_cost.py [steps|curve|all]
"""
import json, statistics, sys, time, torch
sys.path.insert(0, "scripts")
from snac_fast import FastSNAC
from snac_fast.synthetic import synthetic_model
from snac_fast.configs import published_config
from snac_fast.metrics import snr_db
from snac_fast.noise import decode_with_keyed_noise
from lookahead_curve import zero_noise_gains, codes_for, frames_of

out = {"steps": {}, "curve": {}}
torch.set_grad_enabled(False)
import os
DEV = os.environ.get("DEV", "cuda")
MODELS = os.environ.get("MODELS", "snac_24khz:48,snac_32khz:32,snac_44khz:32")
part = sys.argv[1] if len(sys.argv) > 1 else "all"
if part in ("all", "steps"):
    codec = FastSNAC.from_pretrained("synthetic:snac_24khz", device="cuda")
    config = codec.config
    looks = {"exact": None, "2048": 2048, "fp16": "fp16", "0": 0}
    engines = {k: codec.stream_engine(256, lookahead=v) for k, v in looks.items()}
    for k, e in engines.items():
        t0 = time.perf_counter(); n = e.warmup(); print(k, "warmup", n, round(time.perf_counter() - t0, 1), flush=True)
    gen = torch.Generator().manual_seed(0)
    s = config["vq_strides"]
    for S in (1, 16, 64, 256):
        slots = {k: [e.open(seed=i) for i in range(S)] for k, e in engines.items()}
        group = engines["exact"].frames_per_group
        def codes():
            return [torch.randint(0, 4096, (S, group * s[0] // x), generator=gen) for x in s]
        for _ in range(8):  # prefill and settle
            for k, e in engines.items():
                e.step(slots[k], codes())
        times = {k: ([], []) for k in engines}
        for r in range(40):
            for k, e in engines.items():
                c = codes()
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter(); a.record()
                e.step(slots[k], c)
                b.record(); torch.cuda.synchronize()
                times[k][0].append((time.perf_counter() - t0) * 1e3); times[k][1].append(a.elapsed_time(b))
        row = {k: {"call_ms": statistics.median(w), "gpu_ms": statistics.median(g)} for k, (w, g) in times.items()}
        for k in row:
            row[k]["gpu_vs_exact"] = row[k]["gpu_ms"] / row["exact"]["gpu_ms"]
        out["steps"][S] = row
        print(S, json.dumps(row), flush=True)
        for k, e in engines.items():
            for sl in slots[k]:
                e.close(sl)
    del engines, codec
    torch.cuda.empty_cache()
if part in ("all", "curve"):
    for name, frames in [(m.split(":")[0], int(m.split(":")[1])) for m in MODELS.split(",")]:
        config = published_config(name)
        quiet = synthetic_model(name)
        zero_noise_gains(quiet)
        ref = synthetic_model(name).double(); zero_noise_gains(ref)
        codes = codes_for(config, frames, 3)
        t0 = time.perf_counter()
        whole = decode_with_keyed_noise(ref, codes, 1)[0, 0]
        codec = FastSNAC(quiet, device=DEV, dtype=torch.float16 if DEV == "cuda" else torch.float32)
        fp16_whole = codec.decode([c.to(DEV) for c in codes], seed=1)[0, 0].double().cpu()
        rows = {"fp16_whole_decode_db": round(snr_db(whole, fp16_whole), 2)}
        full = codec.stream_engine(1).lookahead_samples
        per = codec.stream_engine(1).samples_per_frame
        for L in [0, 1024, 2048, 3072, 4096, 6144, 8192, 12032, "fp16", None]:
            if isinstance(L, int) and L >= full:
                continue
            e = codec.stream_engine(1, lookahead=L)
            g = e.frames_per_group
            sl = e.open(seed=1)
            pieces = [e.advance({sl: [c.to(DEV) for c in frames_of(codes, config["vq_strides"], f, f + g)]})[sl].double().cpu()
                      for f in range(0, frames, g)]
            pieces.append(e.advance(finish=[sl])[sl].double().cpu())
            audio = torch.cat(pieces)
            span = slice(8 * per, frames * per - max(e.lookahead_samples, g * per) - g * per)
            rows[str(L if L is not None else "exact")] = {"lookahead": e.lookahead_samples, "first_audio_frames": e.first_audio_frames,
                                      "fp16_stream_db": round(snr_db(whole[span], audio[span]), 2), "len_ok": audio.numel() == whole.numel()}
        out["curve"][name] = rows
        print(name, round(time.perf_counter() - t0, 1), json.dumps(rows), flush=True)
print("JSON", json.dumps(out))
