"""A/B of the snake computed through the SFU (``sin.approx.f32``, what fp16/bf16 outputs take:
ops/snake ``_sin_sfu``) against the exact range reduction and polynomial (what float32 keeps), in
every fp16 decoder kernel at once (GPU). One mode per process; run the modes alternately:

    for m in poly sfu poly sfu; do python scripts/experiments/ab_sfu_snake.py $m; done

``poly``, before anything compiles, turns the SFU off (ops/snake ``_SFU``) in every kernel, the
Gluon residual unit's included; any other mode runs the product as it is (a label: compare two
trees by their PYTHONPATH). Prints one JSON line: GPU ms (median of ``calls``) of graphed fp16
decodes of each workload of ``scripts/bench_decode.py``, and the fp16 decode's SNR against upstream
float32 on a 5 s decode (``snac_fast.fidelity.compare``), with plain upstream fp16's.

    python scripts/experiments/ab_sfu_snake.py MODE [models, comma separated] [calls]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/

import torch  # noqa: E402


def use_polynomial_snake() -> None:
    """Every kernel's snake, the Gluon unit's included, through the exact polynomial (ops/snake
    ``_snake_sine`` reads ``_SFU`` when a kernel compiles)."""
    import triton.language as tl

    from snac_fast.ops import snake

    snake._SFU = tl.constexpr(False)


def main() -> None:
    mode = sys.argv[1]
    models = sys.argv[2].split(",") if len(sys.argv) > 2 else ["snac_24khz", "snac_32khz"]
    calls = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    if mode == "poly":
        use_polynomial_snake()
    from bench_common import timed_call
    from bench_decode import codes_for, workloads

    from snac_fast import FastSNAC
    from snac_fast.configs import published_config
    from snac_fast.fidelity import compare
    from snac_fast.synthetic import synthetic_model

    out = {"mode": mode, "ms": {}, "snr_db": {}}
    for name in models:
        codec = FastSNAC(synthetic_model(name), device="cuda", dtype=torch.float16)
        cfg = published_config(name)
        for label, frames, batch in workloads(name):
            codes = codes_for(cfg, frames, batch, 0)
            run = lambda: codec.decode(codes, seed=0)  # noqa: E731
            for _ in range(3):
                run()
            out["ms"][f"{name} {label}"] = round(statistics.median(timed_call(run)[1] for _ in range(calls)), 4)
            if label.startswith("5 s"):
                report = compare(codec, codes=codes)
                out["snr_db"][name] = [round(report.snr_db, 2), round(report.baseline_snr_db, 2)]
        codec = None  # noqa: F841
        torch.cuda.empty_cache()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
