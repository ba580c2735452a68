"""Snake kernel benchmark (GPU): forward and forward+backward against upstream eager, torch.compile
of the torch reference, and a device copy of the same bytes.

    python scripts/bench_snake.py --out benchmarks/snake_h100       # JSON + Markdown; its PNG in docs/
    python scripts/bench_snake.py --tune                            # sweep launch configs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import environment, markdown_table, median_ms, write_results  # noqa: E402

import snac_fast.ops.snake as snake_ops  # noqa: E402
from snac_fast.ops.snake import snake, snake_reference  # noqa: E402

SNAC_SHAPES = [(1, 1024, 236), (1, 512, 1888), (1, 256, 15104), (1, 128, 60416), (1, 64, 120832)]
SWEEP_SIZES = [2**k for k in range(14, 27, 2)]  # 16K .. 64M elements, as [1, 64, n/64]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
N_INPUT_SETS = 3


def upstream_snake(x, alpha):
    from snac.layers import snake as upstream  # the TorchScript function upstream's Snake1d calls

    return upstream(x, alpha)


def make_inputs(shape, dtype, requires_grad=False):
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    sets = []
    for _ in range(N_INPUT_SETS):
        x = torch.randn(shape, device="cuda", dtype=dtype, generator=gen).mul_(3)
        alpha = torch.exp(torch.empty(1, shape[1], 1, device="cuda").uniform_(-1.6, 1.6, generator=gen)).to(dtype)
        g = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
        sets.append((x.requires_grad_(requires_grad), alpha.requires_grad_(requires_grad), g))
    return sets


def fwd_bwd(fn):
    def run(x, alpha, g):
        return torch.autograd.grad(fn(x, alpha), (x, alpha), g)

    return run


def bench_shape(shape, dtype, compiled):
    numel = shape[0] * shape[1] * shape[2]
    esize = torch.empty(0, dtype=dtype).element_size()
    fwd_bytes = 2 * numel * esize  # read x, write y
    bwd_bytes = 3 * numel * esize  # read x and g, write dx
    sets = make_inputs(shape, dtype)
    outs = [torch.empty(shape, device="cuda", dtype=dtype) for _ in sets]
    copy_sets = [(o, s[0]) for o, s in zip(outs, sets)]
    t = {
        "copy": median_ms(lambda o, x: o.copy_(x), copy_sets),
        "fwd_ours": median_ms(lambda x, a, g: snake(x, a), sets),
        "fwd_eager": median_ms(lambda x, a, g: upstream_snake(x, a), sets),
        "fwd_compile": median_ms(lambda x, a, g: compiled(x, a), sets),
        "bwd_kernel": median_ms(lambda x, a, g: snake_ops._backward_triton(g, x, a), sets),
    }
    gsets = make_inputs(shape, dtype, requires_grad=True)
    t["fwdbwd_ours"] = median_ms(fwd_bwd(snake), gsets)
    t["fwdbwd_eager"] = median_ms(fwd_bwd(upstream_snake), gsets)
    t["fwdbwd_compile"] = median_ms(fwd_bwd(compiled), gsets)
    copy_gbs = fwd_bytes / t["copy"] / 1e6
    return {
        "shape": list(shape), "numel": numel, "ms": t,
        "fwd_gbs": fwd_bytes / t["fwd_ours"] / 1e6,
        "copy_gbs": copy_gbs,
        "fwd_pct_copy": 100 * t["copy"] / t["fwd_ours"],
        "bwd_gbs": bwd_bytes / t["bwd_kernel"] / 1e6,
        "bwd_pct_floor": 100 * (bwd_bytes / (copy_gbs * 1e6)) / t["bwd_kernel"],
        "fwd_speedup_eager": t["fwd_eager"] / t["fwd_ours"],
        "fwd_speedup_compile": t["fwd_compile"] / t["fwd_ours"],
        "fwdbwd_speedup_eager": t["fwdbwd_eager"] / t["fwdbwd_ours"],
        "fwdbwd_speedup_compile": t["fwdbwd_compile"] / t["fwdbwd_ours"],
    }


def tune():
    """Time forward and backward for several tile sizes and warp counts (heuristic's raw material)."""
    for dname, dtype in DTYPES.items():
        for shape in [(1, 64, 120832), (1, 1024, 65536), (1, 256, 15104), (1, 1024, 16)]:
            sets = make_inputs(shape, dtype)
            n = shape[1] * shape[2]
            copy = median_ms(lambda x, a, g: x.clone(), sets)
            res = []
            for tile in (1024, 2048, 4096, 8192, 16384):
                for warps in (2, 4, 8, 16):
                    if tile // (32 * warps) < 1:
                        continue
                    block_t = min(1 << (shape[2] - 1).bit_length(), tile)
                    rows = max(1, tile // block_t)
                    cfg = (rows, block_t, warps)
                    f = median_ms(lambda x, a, g: snake_ops._forward_triton(x, a, cfg), sets)
                    b = median_ms(lambda x, a, g: snake_ops._backward_triton(g, x, a, cfg), sets)
                    res.append((f, b, tile, warps))
            best_f = min(res)
            best_b = min(res, key=lambda r: r[1])
            heur = snake_ops._launch_config(shape[1], shape[2], torch.empty(0, dtype=dtype).element_size())
            fh = median_ms(lambda x, a, g: snake_ops._forward_triton(x, a), sets)
            print(f"{dname} {shape} n={n}: copy {copy*1e3:.1f}us | best fwd {best_f[0]*1e3:.1f}us tile={best_f[2]} w={best_f[3]} "
                  f"| best bwd {best_b[1]*1e3:.1f}us tile={best_b[2]} w={best_b[3]} | heuristic {heur} fwd {fh*1e3:.1f}us")


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for dname in DTYPES:
        rows = [r for r in results if r["dtype"] == dname and r["kind"] == "sweep"]
        n = [r["numel"] for r in rows]
        ax.plot(n, [r["fwd_gbs"] for r in rows], "o-", label=f"snac-fast {dname}")
        ax.plot(n, [r["copy_gbs"] for r in rows], "k:", alpha=0.5)
        ax.plot(n, [r["fwd_gbs"] / r["fwd_speedup_eager"] for r in rows], "x--", alpha=0.6, label=f"upstream eager {dname}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("elements")
    ax.set_ylabel("GB/s (bytes read + written)")
    ax.set_title("Snake forward vs upstream eager (dotted: copy of the same bytes)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/snake"))
    ap.add_argument("--tune", action="store_true")
    args = ap.parse_args()
    if args.tune:
        tune()
        return
    compiled = torch.compile(snake_reference)
    results = []
    for dname, dtype in DTYPES.items():
        for kind, shapes in (("snac", SNAC_SHAPES), ("sweep", [(1, 64, n // 64) for n in SWEEP_SIZES])):
            for shape in shapes:
                r = bench_shape(shape, dtype, compiled)
                r.update(dtype=dname, kind=kind)
                results.append(r)
                print(f"{dname} {shape}: fwd {r['fwd_gbs']:.0f} GB/s ({r['fwd_pct_copy']:.0f}% of copy), "
                      f"{r['fwd_speedup_eager']:.2f}x eager, {r['fwd_speedup_compile']:.2f}x compile | "
                      f"bwd {r['bwd_pct_floor']:.0f}% of floor | fwd+bwd {r['fwdbwd_speedup_eager']:.2f}x eager", flush=True)
    env = environment()
    header = ["dtype", "shape", "fwd µs", "fwd GB/s", "% of copy", "vs eager", "vs compile",
              "bwd % of floor", "fwd+bwd µs", "fwd+bwd vs eager", "fwd+bwd vs compile"]
    rows = [[r["dtype"], "×".join(map(str, r["shape"])), f"{r['ms']['fwd_ours']*1e3:.1f}", f"{r['fwd_gbs']:.0f}",
             f"{r['fwd_pct_copy']:.0f}%", f"{r['fwd_speedup_eager']:.2f}x", f"{r['fwd_speedup_compile']:.2f}x",
             f"{r['bwd_pct_floor']:.0f}%", f"{r['ms']['fwdbwd_ours']*1e3:.1f}", f"{r['fwdbwd_speedup_eager']:.2f}x",
             f"{r['fwdbwd_speedup_compile']:.2f}x"] for r in results]
    md = (f"# Snake kernel benchmark\n\n{env['device']}, {env['date']}, torch {env['torch']}, triton {env['triton']}. "
          "GPU time per call: median over CUDA-graph replays timed with CUDA events, 3 input sets rotated in each replay. "
          "'% of copy': a device copy of the same bytes over our time.\n\n" + markdown_table(header, rows))
    write_results(args.out.parent, args.out.name, {"environment": env, "results": results}, md)
    plot(results, Path(__file__).resolve().parents[1] / "docs" / f"{args.out.name}.png")  # docs/kernels.md shows it
    print(md)


if __name__ == "__main__":
    main()
