"""What state per layer could save in a stream step, bounded before building it (#45; GPU).

The stream engine runs each stage (the decoder's front, then one DecoderBlock per stage) on
[context | new] and crops the new outputs, so every step recomputes each stage's context (block 1
at 24 kHz: 128 samples a stream for 32 new; docs/kernels.md, "The 64-stream step"). With state per
layer, each layer would compute its new outputs only. This times each stage's own layers (the
product's fused modules, CUDA graphs, fp16, keyed noise replaced by a fixed buffer in both arms) at
the buffer length a one-frame step gives them now (context + new) and at the new samples alone:
the second is a floor for state per layer (it leaves out reading and writing each layer's state),
so the difference bounds what the change could save, stage by stage.

    python scripts/experiments/per_layer_bound.py --streams 64 [--model snac_24khz] [--out FILE.json]

On a CPU (``--device cpu``, no graphs) it checks the shapes only; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from snac_fast import FastSNAC
from snac_fast.noise import patched_noise
from snac_fast.streaming import engine as engine_module


def stage_inputs(engine, codec, streams: int) -> list[dict]:
    """Each stage's buffer in a one-frame step of ``streams`` rows: its shape, whether channels-last,
    and its new samples (recorded from a real step through ``context_step``)."""
    seen = []
    real = engine_module.context_step

    def recording(state, slots, new, channels_last=False):
        out = real(state, slots, new, channels_last=channels_last)
        seen.append({"shape": tuple(out.shape), "channels_last": out.stride(1) == 1 and out.shape[1] > 1,
                     "new": new.shape[2], "context": state.shape[2]})
        return out

    strides = codec.config["vq_strides"]
    frames = engine.prefill_frames
    ids = [engine.open(seed=i) for i in range(streams)]
    gen = torch.Generator().manual_seed(0)

    def codes(n):
        return [torch.randint(0, codec.config["codebook_size"], (streams, n * strides[0] // s), generator=gen).to(codec.device)
                for s in strides]
    engine.step(ids, codes(frames))  # the prefill
    engine_module.context_step = recording
    try:
        engine.step(ids, codes(1))
    finally:
        engine_module.context_step = real
    for i in ids:
        engine.close(i)
    return seen


def timed(fn, graphs: bool, rounds: int) -> float:
    """Median GPU ms of ``fn`` (replayed from a CUDA graph when ``graphs``)."""
    if graphs:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        fn = graph.replay
    times = []
    for _ in range(rounds):
        if graphs:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            fn()
            times.append(float("nan"))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="snac_24khz")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    codec = FastSNAC.from_pretrained(f"synthetic:{args.model}", device=device)  # fp16 on CUDA
    dtype = codec.dtype
    engine = codec.stream_engine(max_streams=args.streams, cuda_graphs=False)  # eager: every stage runs context_step
    inputs = stage_inputs(engine, codec, args.streams)
    stages = engine.geometry.stages
    assert len(inputs) == len(stages), (len(inputs), len(stages))
    graphs = device.type == "cuda"
    rows = []
    with torch.inference_mode():
        for l, (stage, seen) in enumerate(zip(stages, inputs)):
            B, C, length = seen["shape"]
            result = {"stage": l, "channels": C, "context": seen["context"], "new": seen["new"],
                      "upsample": stage.upsample}
            for arm, T in (("context_and_new", length), ("new_only", seen["new"])):
                shape = (B, T, C) if seen["channels_last"] else (B, C, T)
                x = torch.randn(shape, device=device, dtype=dtype)
                x = x.transpose(1, 2) if seen["channels_last"] else x
                noises = {}

                def noise(index: int, y: torch.Tensor, noises=noises) -> torch.Tensor:
                    # a fixed buffer per NoiseBlock: both arms pay no keyed-noise kernel
                    if index not in noises:
                        noises[index] = torch.randn(y.shape[0], 1, y.shape[2], device=device, dtype=y.dtype)
                    return noises[index]

                def run(x=x, stage=stage) -> torch.Tensor:
                    y = x
                    for layer in stage.layers:
                        y = layer(y)
                    return y

                with patched_noise(codec.model, noise):
                    run()  # the noise buffers, before any capture
                    result[f"{arm}_samples"] = T
                    result[f"{arm}_ms"] = timed(run, graphs, args.rounds)
            rows.append(result)
            print(result, flush=True)
    if graphs:
        total_now = sum(r["context_and_new_ms"] for r in rows)
        total_floor = sum(r["new_only_ms"] for r in rows)
        print(f"stages' layers: {total_now:.3f} ms now, {total_floor:.3f} ms computing new samples only "
              f"(at most {total_now - total_floor:.3f} ms a step to gain, before the state's reads and writes)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "streams": args.streams, "device": torch.cuda.get_device_name() if graphs else "cpu",
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
