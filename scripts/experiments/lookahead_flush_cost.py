"""Where an approximate step's GPU time goes (24 kHz fp16, lookahead 2048, CUDA events, median
of 30): the whole approximate step, the exact step alone, the state copy and restore, the flush
of a copy of the state. Results: benchmarks/stream_approximate_24khz_h100.{md,json}.

    python scripts/experiments/lookahead_flush_cost.py
"""
import json, statistics, torch
from snac_fast import FastSNAC
from snac_fast.streaming.engine import FLUSH, _slots_of
torch.set_grad_enabled(False)
torch.inference_mode().__enter__()
codec = FastSNAC.from_pretrained("synthetic:snac_24khz", device="cuda")
e = codec.stream_engine(256, lookahead=2048)
e.warmup()
s = codec.config["vq_strides"]; g = e.frames_per_group
gen = torch.Generator().manual_seed(0)
def ev(fn, n=30):
    t = []
    for _ in range(n):
        torch.cuda.synchronize(); a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); t.append(a.elapsed_time(b))
    return statistics.median(t)
out = {}
for S in (16, 64, 256):
    slots = [e.open(seed=i) for i in range(S)]
    codes = lambda: [torch.randint(0, 4096, (S, g * s[0] // x), generator=gen) for x in s]
    for _ in range(8):
        e.step(slots, codes())
    idx = _slots_of(slots)
    index = torch.from_numpy(idx).cuda()
    def copy():
        saved = [st.index_select(0, index) for st in e.state]
        for st, rows in zip(e.state, saved):
            st.index_copy_(0, index, rows)
    def flush():
        saved = [st.index_select(0, index) for st in e.state]
        e._run(FLUSH, idx, 0)
        for st, rows in zip(e.state, saved):
            st.index_copy_(0, index, rows)
    def flush_only():
        e._run(FLUSH, idx, 0)
    row = {"approx_step": ev(lambda: e.step(slots, codes())), "exact_step": ev(lambda: e._step(tuple(slots), codes())),
           "state_copy": ev(copy), "flush_only": ev(flush_only), "flush_with_copy": ev(flush),
           "state_mib": sum(st[:S].numel() * st.element_size() for st in e.state) / 2**20}
    out[S] = row
    print(S, json.dumps(row), flush=True)
    for sl in slots:
        e.close(sl)
print("JSON", json.dumps(out))
