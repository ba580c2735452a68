"""In-process A/B of the stream context kernel's tiles (``ops/context.py:_context_tile``): 24 kHz
stream engines captured under the old fixed tiles and the rule at 2048 and 4096 elements per
program, their step graphs replayed interleaved at 1/16/64/256 streams (GPU time, warm L2,
medians of 300), outputs compared bitwise, then the context kernels' time per replay from the
profiler. Prints each stage's context shapes once.

    python scripts/experiments/ab_context_tiles.py
"""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/, for bench_common
from bench_common import timed_call  # noqa: E402

from snac_fast import FastSNAC  # noqa: E402
from snac_fast.ops import context as ctx  # noqa: E402
import snac_fast.streaming.engine as st  # noqa: E402
from snac_fast.streaming import StreamEngine  # noqa: E402

codec = FastSNAC.from_pretrained("synthetic:snac_24khz", device="cuda")
strides = codec.config["vq_strides"]
new_rule = ctx._context_tile


def rule_at(elements):
    """The rule with ``elements`` per program (it reads the module constant at each call)."""
    def rule(C, T, channels_last):
        ctx._CONTEXT_TILE = elements
        return new_rule(C, T, channels_last)
    return rule


rules = {
    "old 64x32/128x16": lambda C, T, channels_last: (64, 32) if channels_last else (128, 16),
    "new 2048": rule_at(2048),
    "new 4096": rule_at(4096),
}
seen = set()
real_step = ctx.context_step


def logged(state, slots, new, channels_last=False):
    key = (tuple(state.shape[1:]), tuple(new.shape), channels_last)
    if key not in seen and new.shape[0] in (1, 64):
        seen.add(key)
        print("context", "C,H", tuple(state.shape[1:]), "new", tuple(new.shape), "channels_last", channels_last,
              "tile", ctx._context_tile(state.shape[1], state.shape[2] + new.shape[2], channels_last))
    return real_step(state, slots, new, channels_last)


st.engine.context_step = logged
gen = torch.Generator().manual_seed(0)
for S in (1, 16, 64, 256):
    engines = {}
    codes = [torch.randint(0, 4096, (S, 40 * strides[0] // s), generator=gen) for s in strides]
    for name, rule in rules.items():
        ctx._context_tile = rule
        e = StreamEngine(codec.model, codec.config, S, device=codec.device, dtype=codec.dtype, cuda_graphs=True, lock=codec.lock)
        slots = [e.open(seed=i) for i in range(S)]
        p = e.prefill_frames
        e.step(slots, [c[:, :p * strides[0] // s] for c, s in zip(codes, strides)])
        outs = []
        for f in range(p, p + 6):
            outs.append(torch.stack(e.step(slots, [c[:, f * strides[0] // s:(f + 1) * strides[0] // s] for c, s in zip(codes, strides)])))
        engines[name] = (e, torch.cat(outs, 1))
    ctx._context_tile = new_rule
    ctx._CONTEXT_TILE = 2048
    ref = engines["old 64x32/128x16"][1]
    same = {n: torch.equal(o, ref) for n, (e, o) in engines.items()}
    times = {n: [] for n in engines}
    for _ in range(300):
        for n, (e, _o) in engines.items():
            times[n].append(timed_call(e._graphs[("step", e._bucket(S), 1)].graph.replay)[1] * 1e3)
    print(f"S={S}: " + " | ".join(f"{n} {statistics.median(t):.1f} us (equal {same[n]})" for n, t in times.items()), flush=True)
    # kernel durations of the context kernels under each rule
    for n, (e, _o) in engines.items():
        g = e._graphs[("step", e._bucket(S), 1)].graph
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                g.replay()
            torch.cuda.synchronize()
        ks = [k for k in prof.key_averages() if "context" in k.key]
        print("   ", n, [(k.key, round(k.device_time_total / 20, 1)) for k in ks])
    del engines
    torch.cuda.empty_cache()
