"""What the one-kernel residual unit (Gluon, ops/residual_unit.py) executes per output element,
counted in its SASS on a CPU (no GPU needed): the kernel compiled for sm_90 as a decode launches it
(pair out, pointers and T 16-divisible), its registers, stack and shared memory, and the SASS
instructions of one [C_P, 64] tile (the kernel has no loops: every instruction runs once a tile)
divided by the outputs each thread computes, with the commonest opcodes. ``--polynomial`` gives the
unit the exact range reduction and polynomial sine instead of the SFU's (docs/kernels.md, "The
snake's sine from the SFU").

    python scripts/experiments/sass_counts.py [--polynomial] [--channels 64 128] [--dilations 1 3 9]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

POINTERS = ["x_ptr", "s_ptr", "w_ptr", "dw_w_ptr", "dw_b_ptr", "alpha2_ptr", "pw_b_ptr", "alpha_out_ptr", "out_ptr",
            "snake_out_ptr"]
INTS = ["T", "C", "out_stride_b", "out_stride_c", "out_stride_t"]


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def compile_unit(c_p: int, dilation: int):
    from snac_fast.ops import residual_unit

    signature = {**{n: "*fp16" for n in POINTERS}, **{n: "i32" for n in INTS}}
    constexprs = dict(C_P=c_p, DILATION=dilation, BT=64, WARPS_M=4, PAIR=True, SNAKE_OUT=False, CHANNELS_LAST=False,
                      num_warps=8)
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    names = list(signature)
    aligned = POINTERS + ["T", "out_stride_b", "out_stride_c", "out_stride_t"]  # as Triton specializes a decode's
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = GluonASTSource(fn=residual_unit._residual_unit_kernel, signature=signature, constexprs=constexprs,
                            attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})


def opcodes(cubin: bytes) -> collections.Counter:
    ops = collections.Counter()
    for line in _cuobjdump(cubin, "-sass").splitlines():
        # addresses grow past 4 hex digits in kernels over 4,096 instructions
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
    return ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--polynomial", action="store_true")
    parser.add_argument("--channels", type=int, nargs="+", default=[64], help="C_P: 64 or 128")
    parser.add_argument("--dilations", type=int, nargs="+", default=[1, 3, 9])
    args = parser.parse_args()
    if args.polynomial:
        from ab_sfu_snake import use_polynomial_snake  # this script's folder is on the path

        use_polynomial_snake()
    for c_p in args.channels:
        for dilation in args.dilations:
            kernel = compile_unit(c_p, dilation)
            usage = _cuobjdump(kernel.asm["cubin"], "-res-usage")
            regs, stack = re.search(r"REG:(\d+)", usage).group(1), re.search(r"STACK:(\d+)", usage).group(1)
            ops = opcodes(kernel.asm["cubin"])
            per_thread = c_p * 64 // 256  # outputs of one tile over its 8 warps
            total = sum(ops.values())
            common = ", ".join(f"{op} {n / per_thread:.1f}" for op, n in ops.most_common(12))
            print(f"C_P={c_p} dilation {dilation}: {regs} registers, stack {stack}, shared {kernel.metadata.shared} B; "
                  f"{total} SASS instructions a tile = {total / per_thread:.1f} per output element ({common})", flush=True)


if __name__ == "__main__":
    main()
