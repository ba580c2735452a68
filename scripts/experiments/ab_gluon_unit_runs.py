"""Experiment (GPU, Hopper): a 2-pass residual unit, the one-kernel unit of ops/residual_unit.py
with the unit's input snake computed from x as its chunks load and RUN adjacent runs of 8 outputs a
thread (so a halo chunk's snake is recomputed 1.5 / 2 / 3 times at dilation 1 / 3 / 9 with RUN = 4,
not 3 / 5 / 9), y alone out. Against the two kernels and the product's kernel (pair out: 4 passes;
y out: 3), 64 channels, 60 s and a B=32 chunk, CUDA graphs of 20 calls. Results in docs/kernels.md
("The residual unit in one Gluon kernel"), `benchmarks/logs/gluon_unit_runs_h100.log`.

    python scripts/experiments/ab_gluon_unit_runs.py
"""

import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_noise_fold import graph_us  # noqa: E402

from snac_fast.ops.common import _snake_broadcast  # noqa: E402
from snac_fast.ops.depthwise import _lanes, _window, depthwise_conv_snake  # noqa: E402
from snac_fast.ops.pointwise import pointwise_conv_pair  # noqa: E402
from snac_fast.ops.residual_unit import _unit_tail, residual_unit, residual_unit_reference  # noqa: E402
from snac_fast.ops.snake import snake_reference  # noqa: E402


@gluon.jit
def _unit_runs_kernel(
    x_ptr, s_ptr, w_ptr, dw_w_ptr, dw_b_ptr, alpha1_ptr, alpha2_ptr, pw_b_ptr, alpha_out_ptr, out_ptr, snake_out_ptr,
    T, C, out_stride_b, out_stride_c, out_stride_t, RUN: gl.constexpr, SNAKE_IN: gl.constexpr,
    C_P: gl.constexpr, DILATION: gl.constexpr, BT: gl.constexpr, WARPS_M: gl.constexpr,
    PAIR: gl.constexpr, SNAKE_OUT: gl.constexpr, CHANNELS_LAST: gl.constexpr, num_warps: gl.constexpr,
):
    """ops/residual_unit's kernel with RUN adjacent runs a thread; SNAKE_IN: s is x and the unit's
    input snake (alpha1) is applied to each loaded chunk."""
    b = gl.program_id(1)
    t0 = gl.program_id(0) * BT
    NG: gl.constexpr = BT // (8 * RUN)  # groups of RUN adjacent runs of 8 a row
    CH: gl.constexpr = (3 * DILATION + 7) // 8
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [32 // NG, NG, 1], [num_warps, 1, 1], [2, 1, 0])
    L2: gl.constexpr = gl.SliceLayout(0, L3)
    c = gl.arange(0, C_P, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    g = gl.arange(0, NG, layout=gl.SliceLayout(1, L2))
    e = gl.arange(0, 8, layout=gl.SliceLayout(0, L2))
    c_ok = c < C
    row = (b * C + c).to(gl.int64) * T
    pos = t0 + g[:, None] * (8 * RUN) + e[None, :]
    base = s_ptr + row[:, None, None]
    alpha1 = gl.load(alpha1_ptr + c, mask=c_ok, other=1.0).to(gl.float32)[:, None, None]
    lanes = ()
    for q in gl.static_range(-CH, RUN + CH):
        src = pos + q * 8
        m = c_ok[:, None, None] & ((src >= 0) & (src < T))[None, :, :]
        chunk = gl.load(base + src[None, :, :], mask=m, other=0.0).to(gl.float32)
        if SNAKE_IN:
            chunk = _snake_broadcast(chunk, alpha1)
        lanes = lanes + _lanes(chunk)
    bias = gl.load(dw_b_ptr + c, mask=c_ok, other=0.0).to(gl.float32)[:, None, None]
    alpha2 = gl.load(alpha2_ptr + c, mask=c_ok, other=1.0).to(gl.float32)[:, None, None]
    hs = ()
    for j in gl.static_range(RUN):
        acc3 = gl.zeros([C_P, NG, 8], gl.float32, L3)
        for k in gl.static_range(7):
            wk = gl.load(dw_w_ptr + c * 7 + k, mask=c_ok, other=0.0).to(gl.float32)
            tap = gl.convert_layout(_window(lanes, (k - 3) * DILATION + 8 * (CH + j)), L3, assert_trivial=True)
            acc3 += wk[:, None, None] * tap
        hs = hs + (_snake_broadcast(acc3 + bias, alpha2).to(gl.float16),)
    if RUN == 1:
        h = gl.reshape(hs[0], (C_P, BT))
    elif RUN == 2:
        h = gl.reshape(gl.permute(gl.join(hs[0], hs[1]), (0, 1, 3, 2)), (C_P, BT))
    else:
        h = gl.reshape(gl.permute(gl.join(gl.join(hs[0], hs[1]), gl.join(hs[2], hs[3])), (0, 1, 4, 3, 2)), (C_P, BT))

    _unit_tail(h, x_ptr, w_ptr, pw_b_ptr, alpha_out_ptr, out_ptr, snake_out_ptr, b, t0, T, C,
               out_stride_b, out_stride_c, out_stride_t, C_P, BT, WARPS_M, PAIR, SNAKE_OUT, CHANNELS_LAST)


def runs_unit(x, dw_w, b, dil, a2, pw_w, pw_b, a1, out, RUN, BT, wm):
    B, C, T = x.shape
    _unit_runs_kernel[(-(-T // BT), B)](x, x, pw_w.reshape(C, C), dw_w.reshape(C, 7), b, a1, a2, pw_b, a2, out, out,
                                        T, C, out.stride(0), out.stride(1), out.stride(2), RUN=RUN, SNAKE_IN=True,
                                        C_P=64, DILATION=dil, BT=BT, WARPS_M=wm, PAIR=False, SNAKE_OUT=False,
                                        CHANNELS_LAST=False, num_warps=8)
    return out


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    VAR = [(4, 128, 8), (2, 128, 8), (2, 64, 4), (4, 64, 4)]
    for B, C, T in [(1, 64, 1439744), (32, 64, 8192)]:
        for dil in (1, 3, 9):
            x = (torch.randn(B, C, T, generator=gen) * 0.5).half().cuda()
            a1 = torch.rand(C, device="cuda") + 0.5
            s = snake_reference(x.float(), a1).half()
            dw_w = (torch.randn(C, 1, 7, generator=gen) * 0.3).half().cuda()
            pw_w = (torch.randn(C, C, 1, generator=gen) / C**0.5).half().cuda()
            b, a = (torch.randn(C, generator=gen) * 0.1).half().cuda(), torch.rand(C, device="cuda") + 0.5
            out = torch.empty_like(x)
            ref = residual_unit_reference(x.double(), snake_reference(x.double(), a1.double()), dw_w.double(), b.double(), dil,
                                          a.double(), pw_w.double(), b.double())
            errs = []
            for RUN, BT, wm in VAR:
                o = torch.full_like(x, float("nan"))
                runs_unit(x, dw_w, b, dil, a, pw_w, b, a1, o, RUN, BT, wm)
                errs.append(((o.double() - ref).abs().max() / ref.abs().max()).item())
            t = {"two kernels pair (6)": graph_us(lambda: pointwise_conv_pair(depthwise_conv_snake(s, dw_w, b, dil, a), pw_w, b, residual=x, alpha=a, out=out)),
                 "one pair (4)": graph_us(lambda: residual_unit(x, s, dw_w, b, dil, a, pw_w, b, pair_alpha=a, out=out)),
                 "one y (3)": graph_us(lambda: residual_unit(x, s, dw_w, b, dil, a, pw_w, b, out=out))}
            for RUN, BT, wm in VAR:
                t[f"snake in, y (2), RUN={RUN} BT={BT}"] = graph_us(lambda: runs_unit(x, dw_w, b, dil, a, pw_w, b, a1, out, RUN, BT, wm))
            base = t["two kernels pair (6)"]
            print(f"B={B} C={C} T={T} d={dil} errs {[f'{e:.1e}' for e in errs]}: " + " | ".join(f"{k} {v:.1f} us {base / v:.2f}x" for k, v in t.items()), flush=True)


if __name__ == "__main__":
    main()
