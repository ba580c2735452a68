"""A stand-in for an LM server sharing the GPU (issue 75): a Llama-3.2-3B-shaped bf16 decode step
for a batch of sequences, captured in one CUDA graph and replayed back to back, in a process that
first takes a share of the card's memory as vLLM does (``--gpu-memory-utilization``, 0.9 like
vLLM's default: weights, a KV cache and the rest of the share left reserved).

Every ``--report-every`` seconds it appends ``<monotonic time> <steps so far>`` to ``--log``, so a
harness reads its steps per second over any window (CLOCK_MONOTONIC is one clock for all
processes). Runs until killed.

    python scripts/colocated_lm.py --log /tmp/lm_steps.txt
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

# Llama 3.2 3B
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 3072, 8192, 28, 24, 8, 128256
HEAD_DIM = HIDDEN // HEADS


class DecodeStep:
    """One decode step of ``batch`` sequences attending ``context`` cached positions, layer by layer:
    QKV, attention over the cache (SDPA), O, gate/up, down, and the LM head: the GEMMs and memory
    reads of a real step (no sampling)."""

    def __init__(self, batch: int, context: int, device: torch.device) -> None:
        dt = torch.bfloat16
        w = lambda *shape: torch.randn(*shape, device=device, dtype=dt) * 0.02  # noqa: E731
        self.layers = [(w(HIDDEN, HIDDEN + 2 * KV_HEADS * HEAD_DIM), w(HIDDEN, HIDDEN), w(HIDDEN, 2 * INTERMEDIATE),
                        w(INTERMEDIATE, HIDDEN)) for _ in range(LAYERS)]
        self.head = w(HIDDEN, VOCAB)
        self.cache = [(torch.randn(batch, KV_HEADS, context, HEAD_DIM, device=device, dtype=dt),
                       torch.randn(batch, KV_HEADS, context, HEAD_DIM, device=device, dtype=dt)) for _ in range(LAYERS)]
        self.x = torch.randn(batch, HIDDEN, device=device, dtype=dt)
        self.batch = batch

    def __call__(self) -> torch.Tensor:
        x = self.x
        for (qkv, o, up, down), (k_cache, v_cache) in zip(self.layers, self.cache):
            q = (x @ qkv)[:, :HIDDEN].view(self.batch, HEADS, 1, HEAD_DIM)
            attn = torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)
            x = x + attn.reshape(self.batch, HIDDEN) @ o
            gate, value = (x @ up).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * value) @ down
        return x @ self.head


def start(log: str, memory_share: float, out_log: str, timeout: float = 180.0) -> subprocess.Popen:
    """This script in a process of its own, once it is stepping (its ``log`` has a line)."""
    open(log, "w").close()
    with open(out_log, "w") as out:
        proc = subprocess.Popen([sys.executable, __file__, "--log", log, "--gpu-memory-utilization", f"{memory_share:g}"],
                                stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the co-located LM exited: {open(out_log).read()[-2000:]}")
        if os.path.getsize(log):
            return proc
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the co-located LM did not start stepping")


def steps_per_second(log: str, start: float, stop: float) -> float:
    """The LM's steps per second between two ``time.monotonic()`` readings (its log's lines inside them)."""
    points = [(t, n) for t, n in (map(float, line.split()) for line in open(log) if line.strip()) if start <= t <= stop]
    if len(points) < 2:
        return float("nan")
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def mps_start(folder: str) -> bool:
    """Start the MPS control daemon (its pipes in ``folder``; this process's children use it).
    Whether it started."""
    os.environ["CUDA_MPS_PIPE_DIRECTORY"] = os.path.join(folder, "pipe")
    os.environ["CUDA_MPS_LOG_DIRECTORY"] = os.path.join(folder, "log")
    for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        os.makedirs(os.environ[key], exist_ok=True)
    try:
        return subprocess.run(["nvidia-cuda-mps-control", "-d"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def mps_stop() -> None:
    try:
        subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64, help="sequences per decode step")
    parser.add_argument("--context", type=int, default=1024, help="cached positions each sequence attends")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of the card this process holds, as vLLM's flag (0: only what the step needs)")
    parser.add_argument("--log", required=True)
    parser.add_argument("--report-every", type=float, default=0.1)
    args = parser.parse_args()
    device = torch.device("cuda")
    step = DecodeStep(args.batch, args.context, device)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        step()
    free, total = torch.cuda.mem_get_info(device)
    # what vLLM takes: its share of the card in all, the rest of it as one reserve (its KV cache blocks)
    if args.gpu_memory_utilization:
        extra = int(args.gpu_memory_utilization * total) - (total - free)
        if extra > 0:  # held beside the step's own tensors until the process is killed
            step.reserve = torch.empty(extra, dtype=torch.uint8, device=device)
    free, _ = torch.cuda.mem_get_info(device)
    print(f"colocated LM: batch {args.batch}, context {args.context}, holding {(total - free) / 1e9:.1f} of "
          f"{total / 1e9:.1f} GB (pid {os.getpid()})", flush=True)
    steps, next_report = 0, time.monotonic()
    with open(args.log, "a", buffering=1) as log:
        while True:
            graph.replay()
            torch.cuda.synchronize()  # as an LM server's step: its sampled tokens go to the host
            steps += 1
            now = time.monotonic()
            if now >= next_report:
                log.write(f"{now:.6f} {steps}\n")
                next_report = now + args.report_every


if __name__ == "__main__":
    main()
