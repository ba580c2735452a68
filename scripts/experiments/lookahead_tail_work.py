"""Work of an approximate stream's per-push tail decode, full flush against the cut tail
(``StreamEngine`` kind ``tail``): CPU time (float32, torch ops) and samples per stage, 24 kHz, 4
streams. A proxy for the GPU's work, not a GPU figure.

    python scripts/experiments/lookahead_tail_work.py
"""
import statistics
import time

import torch

from snac_fast import FastSNAC
from snac_fast.streaming.engine import FLUSH, TAIL, _slots_of

torch.set_grad_enabled(False)
codec = FastSNAC.from_pretrained("synthetic:snac_24khz", device="cpu", dtype=torch.float32)
s = codec.config["vq_strides"]
for lookahead in (0, 2048, "fp16", 4096):
    engine = codec.stream_engine(4, lookahead=lookahead)
    streams = [engine.open(seed=i) for i in range(4)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        engine.step(streams, [torch.randint(0, 4096, (4, s[0] // x), generator=gen) for x in s])
    slots = _slots_of(streams)
    index = torch.from_numpy(slots)
    times = {FLUSH: [], TAIL: []}
    with torch.inference_mode():
        saved = [state.index_select(0, index) for state in engine.state]
        for _ in range(5):
            for kind in (FLUSH, TAIL):
                t0 = time.perf_counter()
                engine._run(kind, slots, 0)
                times[kind].append(time.perf_counter() - t0)
                for state, rows in zip(engine.state, saved):
                    state.index_copy_(0, index, rows)
    full, cut = (statistics.median(times[k]) * 1e3 for k in (FLUSH, TAIL))
    print(f"lookahead {engine.lookahead_samples}: full flush {full:.1f} ms, cut tail {cut:.1f} ms ({cut / full:.2f}); "
          f"outputs kept per stage {engine._tail_keep}", flush=True)
