"""Do the kernels fit the GPUs users have? Checked on a machine without them.

The launch rules choose tiles, warps and pipeline stages from the device's limits
(:class:`~snac_fast.ops.device.GpuLimits`: capability, SM count, shared memory a block). This
module runs a workload on CPU tensors with the rules of another card (:func:`record_launches`,
under ``TRITON_INTERPRET=1``): every kernel launch is recorded, not run. Each distinct launch is
then compiled ahead of time for that card's architecture (:func:`check_fits`, in a process without
the interpreter: ``triton.compile`` with an explicit ``GPUTarget`` needs no GPU) and its shared
memory, registers and spills read from the compiled kernel (cuobjdump).

    python -m snac_fast.targets --gpus rtx3090,l4,rtx4090,a100          # the table, all workloads

What it cannot see: speed, and Triton's value specializations (an int argument equal to 1 or a
pointer's 16-byte alignment change code generation, not the tile's shared memory). The torch
reference path, which runs where no rule applies, is not a kernel and is not recorded.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import torch

from snac_fast.ops import device as ops_device
from snac_fast.ops.device import GPUS, GpuLimits, emulate_gpu

MODELS = ("snac_24khz", "snac_32khz", "snac_44khz")
REGISTERS_PER_THREAD = 255  # every architecture since sm_35


@dataclass(frozen=True)
class Launch:
    """One kernel configuration: where the kernel lives, its argument types and constexpr values,
    and the launch options that change code generation."""

    module: str
    kernel: str
    signature: tuple[tuple[str, str], ...]  # (parameter, Triton type or "constexpr")
    constexprs: tuple[tuple[str, object], ...]
    aligned: tuple[str, ...]  # pointers and ints Triton specializes as divisible by 16
    num_warps: int
    num_stages: int

    def describe(self) -> str:
        values = ", ".join(f"{k}={v}" for k, v in self.constexprs if k.isupper())
        return f"{self.kernel}[{values}] warps={self.num_warps} stages={self.num_stages}"


@dataclass(frozen=True)
class Fit:
    """A compiled launch against a card's limits."""

    launch: Launch
    arch: int
    shared: int  # bytes of shared memory a block uses
    registers: int  # per thread
    spills: int  # stack and local memory a thread uses, bytes (register spills)
    shared_limit: int

    @property
    def fits(self) -> bool:
        return self.shared <= self.shared_limit and self.registers <= REGISTERS_PER_THREAD


def _is_constexpr(annotation) -> bool:
    return annotation is not inspect.Parameter.empty and "constexpr" in str(annotation)


@functools.cache
def _parameters(fn: Callable) -> tuple[tuple[str, inspect.Parameter], ...]:
    """A kernel's parameters (inspect.signature took a third of a recording's time, once a launch)."""
    return tuple(inspect.signature(fn).parameters.items())


def _launch_of(kernel, args: tuple, kwargs: dict) -> Launch:
    """The Launch of ``kernel[grid](*args, **kwargs)`` (an interpreted kernel)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    fn = kernel.fn
    fixed = set(kernel.kwargs.get("do_not_specialize") or ())  # as @triton.jit(do_not_specialize=...) asks
    unaligned = fixed | set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())
    params = _parameters(fn)
    names = [name for name, _ in params]
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in names})
    signature, constexprs, aligned = [], [], []
    for name, param in params:
        value = values.get(name, param.default)
        if _is_constexpr(param.annotation) or value is None:
            kind, key = "constexpr", value
        else:  # as the launch would specialize it: an int 1 becomes a constant, 16-byte multiples "D"
            kind, key = native_specialize_impl(BaseBackend, value, False, name not in fixed, name not in unaligned)
        signature.append((name, kind))
        if kind == "constexpr":
            constexprs.append((name, key))
        elif key == "D":
            aligned.append(name)
    return Launch(fn.__module__, fn.__name__, tuple(signature), tuple(constexprs), tuple(aligned),
                  int(kwargs.get("num_warps", 4)), int(kwargs.get("num_stages", 3)))


def record_launches(run: Callable[[], object], limits: GpuLimits) -> list[Launch]:
    """The distinct kernel launches ``run()`` makes with the rules of a card of ``limits``, in the
    order first made. Needs ``TRITON_INTERPRET=1`` (set before Triton is imported) and CPU tensors;
    kernels are not run: their integer tensors are zeroed (valid indices for what follows), floats
    keep whatever they held, so the audio is meaningless and only shapes and configurations count."""
    if not ops_device.TRITON_INTERPRET:
        raise RuntimeError("record_launches needs TRITON_INTERPRET=1 before Triton is imported")
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[Launch, None] = {}
    original = InterpretedFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        seen.setdefault(_launch_of(self, args, kwargs))
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and not value.is_floating_point():
                value.zero_()

    import torch.nn.functional as F

    # cuDNN's convolutions (long transposed convs run there on GPUs too) and cuBLAS's matmuls are not
    # kernels of ours: only their output's shape is needed, and fp16 on the CPU would take minutes
    # (the 256-stream step's linears alone 8 of its 14 s)
    heavy = {name: getattr(F, name) for name in ("conv1d", "conv2d", "conv_transpose1d", "conv_transpose2d", "linear")}
    InterpretedFunction.run = record
    for name, fn in heavy.items():
        setattr(F, name, _shape_only(fn))
    try:
        with emulate_gpu(limits), torch.inference_mode():
            run()
    finally:
        InterpretedFunction.run = original
        for name, fn in heavy.items():
            setattr(F, name, fn)
    return list(seen)


def _shape_only(fn: Callable) -> Callable:
    """``fn`` evaluated on meta tensors: an uninitialized result of the shape and dtype it would have."""
    def shaped(*args, **kwargs):
        meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
        out = fn(*meta, **{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
        return torch.empty(out.shape, dtype=out.dtype, device=args[0].device)
    return shaped


def workloads(model_name: str) -> dict[str, Callable[[], object]]:
    """What the issue's users run on a model, fp16, at full size (seeded synthetic weights): decode
    chunks (4 frames) at B=1 and 32, 5 s and 60 s decodes, a 5 s encode, stream steps of 1, 64 and
    256 streams (one new frame each, after their prefills)."""
    from snac_fast import FastSNAC
    from snac_fast.configs import published_config
    from snac_fast.model.synthetic import synthetic_model

    config = published_config(model_name)
    codec = FastSNAC(synthetic_model(model_name), device="cpu", dtype=torch.float16)
    rate, strides = config["sampling_rate"], config["vq_strides"]
    hop = codec.hop_length * strides[0]  # samples per frame of the coarsest level

    def codes(batch: int, frames: int) -> list[torch.Tensor]:
        return [torch.zeros(batch, frames * strides[0] // s, dtype=torch.long) for s in strides]

    def decode(batch: int, frames: int) -> Callable[[], object]:
        return lambda: codec.decode(codes(batch, frames), seed=0)

    def seconds(s: float) -> int:  # frames, a multiple of 4 (the 32/44 kHz attention windows)
        return 4 * max(1, round(s * rate / hop / 4))

    def steps(streams: int) -> Callable[[], object]:
        def run():
            engine = codec.stream_engine(max_streams=streams)
            slots = [engine.open(seed=i) for i in range(streams)]
            group = engine.frames_per_group  # steps take whole groups (4 frames at 32/44 kHz)
            engine.step(slots, codes(streams, group * -(-4 // group)))  # the prefills
            engine.step(slots, codes(streams, group))
        return run

    return {
        "decode B=1 chunk": decode(1, 4), "decode B=32 chunk": decode(32, 4),
        "decode 5 s": decode(1, seconds(5)), "decode 60 s": decode(1, seconds(60)),
        "encode 5 s": lambda: codec.encode(torch.zeros(1, 1, 5 * rate, dtype=torch.float16)),
        "stream 1": steps(1), "stream 64": steps(64), "stream 256": steps(256),
    }


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, stack and local memory bytes per thread: where registers spill) of a
    compiled kernel, read by the cuobjdump that ships with Triton."""
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    cuobjdump = os.path.join(os.path.dirname(get_ptxas(80).path), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    registers = int(re.search(r"REG:(\d+)", done.stdout).group(1))
    spilled = sum(int(re.search(rf"{field}:(\d+)", done.stdout).group(1)) for field in ("STACK", "LOCAL"))
    return registers, spilled


def compile_launch(launch: Launch, arch: int):
    """``launch`` compiled for sm_<arch> (Triton's CompiledKernel: ``.asm``, ``.metadata``), in a
    process without Triton's interpreter; no GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(launch.module), launch.kernel)
    names = [name for name, _ in launch.signature]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in launch.aligned}
    source = ASTSource(fn=kernel, signature=dict(launch.signature), constexprs=dict(launch.constexprs), attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})


def _compile_one(item: tuple[dict, int, int]) -> dict:
    """Compile one launch (a Launch as a dict) for sm_<arch> in this (non-interpreting) process."""
    launch_dict, arch, shared_limit = item
    launch = _launch_from(launch_dict)
    compiled = compile_launch(launch, arch)
    registers, spills = _resource_usage(compiled.asm["cubin"])
    return asdict(Fit(launch, arch, int(compiled.metadata.shared), registers, spills, shared_limit))


def check_fits(launches: list[Launch], limits: GpuLimits, workers: int | None = None) -> list[Fit]:
    """Compile each launch for ``limits``' architecture in a subprocess without Triton's
    interpreter (``workers`` compiles at once) and return what each uses."""
    arch = limits.capability[0] * 10 + limits.capability[1]
    items = [(asdict(launch), arch, limits.shared_memory) for launch in launches]
    done = subprocess.run([sys.executable, "-m", "snac_fast.targets", "--compile", "-", "--workers",
                           str(workers or os.cpu_count() or 1)],
                          input=json.dumps(items), capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    if done.returncode:
        raise RuntimeError(f"compiling for sm_{arch} failed:\n{done.stderr[-3000:]}")
    out = []
    for fit in json.loads(done.stdout):
        out.append(Fit(launch=_launch_from(fit.pop("launch")), **fit))
    return out


def _launch_from(fields: dict) -> Launch:
    """A Launch from its JSON form (lists back to tuples)."""
    return Launch(**{**fields, "signature": tuple(map(tuple, fields["signature"])),
                     "constexprs": tuple(map(tuple, fields["constexprs"])), "aligned": tuple(fields["aligned"])})


def _compile_main(path: str, workers: int) -> None:
    items = json.loads(sys.stdin.read() if path == "-" else open(path).read())
    with ProcessPoolExecutor(max(1, workers)) as pool:
        fits = list(pool.map(_compile_one, items))
    json.dump(fits, sys.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default="rtx3090,l4,rtx4090,a100", help=f"of {', '.join(GPUS)}")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", default=None, help="write every compiled launch's figures here")
    parser.add_argument("--compile", default=None, help=argparse.SUPPRESS)  # the compiling subprocess
    args = parser.parse_args()
    if args.compile:
        _compile_main(args.compile, args.workers)
        return
    if not ops_device.TRITON_INTERPRET:
        sys.exit("run with TRITON_INTERPRET=1 (the launches are recorded through Triton's interpreter)")
    report = {}
    for gpu in args.gpus.split(","):
        limits = GPUS[gpu]
        launches: dict[Launch, list[str]] = {}
        for model in args.models.split(","):
            for name, run in workloads(model).items():
                for launch in record_launches(run, limits):
                    launches.setdefault(launch, []).append(f"{model} {name}")
        fits = check_fits(list(launches), limits, args.workers)
        worst = max(fits, key=lambda f: f.shared)
        bad = [f for f in fits if not f.fits]
        print(f"{limits.name}: {len(fits)} kernel configurations; most shared memory {worst.shared} of "
              f"{limits.shared_memory} bytes ({worst.launch.describe()}); most registers "
              f"{max(f.registers for f in fits)}; spills in {sum(1 for f in fits if f.spills)}; "
              f"{'all fit' if not bad else f'{len(bad)} do NOT fit'}")
        for f in bad:
            print(f"  does not fit: {f.launch.describe()} shared {f.shared} registers {f.registers} "
                  f"({', '.join(launches[f.launch][:3])})")
        report[gpu] = {"limits": asdict(limits), "fits": [{**asdict(f), "workloads": launches[f.launch]} for f in fits]}
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1, default=str)


if __name__ == "__main__":
    main()
