"""Shared test helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from snac_fast.configs import published_config
from snac_fast.model.synthetic import synthetic_model
from snac_fast.ops.common import is_channels_last
from snac_fast.streaming import StreamEngine

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, timeout: float = 600) -> subprocess.CompletedProcess:
    """``snac-fast ARGS`` in a process of its own, as a user runs it: the command line's plumbing,
    kernels on their torch references (the kernels themselves are tested in-process through Triton's
    interpreter, which would take minutes on a whole model)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="0")
    return subprocess.run([sys.executable, "-m", "snac_fast.cli", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


# a published model's structure (strides, attention windows, receptive field) at 1/4 to 1/6 of its
# channel widths: for tests whose check is not about full-width tiles, the interpreter runs it fast
NARROW = {"decoder_dim": 256, "encoder_dim": 16}

# A float32 snac-fast decode against upstream's with the same noise measures 122-123 dB and a max
# error under 7e-7 (CPU); a 1e-4 relative error in one Snake alpha or conv weight costs 86-104 dB
# and 5e-6-4e-5 (tests/test_fastsnac.py's mutation test). Both bounds sit between.
FP32_UPSTREAM_SNR_DB = 110.0
FP32_UPSTREAM_MAX_ERROR = 2e-6


def _weight(module):
    """The tensor that scales a conv's weight: weight norm's magnitude g where there is one (scaling
    its direction v changes nothing), else the weight."""
    from torch.nn.utils import parametrize

    if parametrize.is_parametrized(module, "weight"):
        return module.parametrizations.weight.original0
    return module.weight


def _decoder(model, kind, where=lambda module: True, last=False):
    found = [module for module in model.decoder.modules() if isinstance(module, kind) and where(module)]
    return found[-1] if last else found[0]


def _snake(model, last=False):
    from snac.layers import Snake1d

    return _decoder(model, Snake1d, last=last).alpha


# The mutation tests' small errors: (model, codes it will decode) -> the tensor scaled by 1 + 1e-4,
# each standing for a kernel slightly off in one layer (a codebook row the codes use: a wrong gather)
PERTURBATIONS = {
    "first decoder Snake alpha": lambda m, codes: _snake(m),
    "last decoder Snake alpha": lambda m, codes: _snake(m, last=True),
    "a 1x1 conv weight": lambda m, codes: _weight(_decoder(m, torch.nn.Conv1d, lambda c: c.kernel_size[0] == 1)),
    "a transposed conv weight": lambda m, codes: _weight(_decoder(m, torch.nn.ConvTranspose1d)),
    "a depthwise conv weight": lambda m, codes: _weight(_decoder(m, torch.nn.Conv1d, lambda c: c.groups > 1)),
    "a used codebook row": lambda m, codes: m.quantizer.quantizers[0].codebook.weight[int(codes[0][0, 0])],
}


def perturb(model, what: str, codes, relative: float = 1e-4) -> None:
    """Scale one tensor of an upstream ``model`` (:data:`PERTURBATIONS`) by 1 + ``relative``, in place."""
    with torch.no_grad():
        PERTURBATIONS[what](model, codes).mul_(1 + relative)


def assert_matches_upstream_fp32(expected: torch.Tensor, got: torch.Tensor) -> None:
    """A float32 snac-fast output against upstream's: SNR and max error both within the bounds."""
    from snac_fast.metrics import max_abs_error, snr_db

    snr, error = snr_db(expected, got), max_abs_error(expected, got)
    assert snr >= FP32_UPSTREAM_SNR_DB and error <= FP32_UPSTREAM_MAX_ERROR, f"{snr:.1f} dB, max error {error:.2e}"


def random_codes(config: dict, coarse: int, batch: int = 1, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    strides = config["vq_strides"]
    return [torch.randint(0, config["codebook_size"], (batch, coarse * strides[0] // s), generator=gen) for s in strides]


def quiet_codec():
    """A narrow 24 kHz FastSNAC on the CPU with its NoiseBlocks' gains zeroed: a stream's noise (the
    text WebSockets take no seed) then leaves the audio as it is, comparable with an offline decode."""
    from snac.layers import NoiseBlock

    from snac_fast import FastSNAC

    model = synthetic_model("snac_24khz", **NARROW)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, NoiseBlock):
                module.linear.parametrizations.weight.original0.zero_()
    return FastSNAC(model, device="cpu", fuse=False)


def joined_pcm(codec, codes: list[list[torch.Tensor]], seed: int | None = None):
    """The int16 PCM (float64 numpy) of the decode of every segment's codes joined in order: what a
    server's one stream of those segments sends, to its rounding."""
    import numpy as np

    joined = [torch.cat([c[level] for c in codes], dim=1) for level in range(len(codes[0]))]
    audio = codec.decode(joined, seed=seed)[0, 0].double().numpy()
    return np.rint(np.clip(audio, -1, 1) * 32767)


async def pipecat_spoken(tts, text: str) -> list:
    """Every frame a Pipecat pipeline of ``tts`` alone pushes while it speaks ``text`` as one turn
    (24 kHz output; pipecat's DEBUG log silenced)."""
    from loguru import logger
    from pipecat.frames.frames import EndFrame, TTSSpeakFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.workers.runner import WorkerRunner

    logger.remove()

    class Collected(FrameProcessor):
        def __init__(self):
            super().__init__()
            self.frames = []

        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            self.frames.append(frame)
            await self.push_frame(frame, direction)

    collected = Collected()
    worker = PipelineWorker(Pipeline([tts, collected]), params=PipelineParams(audio_out_sample_rate=24000))
    await worker.queue_frames([TTSSpeakFrame(text), EndFrame()])
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await runner.run()
    return collected.frames


_UPSTREAM: dict = {}


def upstream64(name: str, narrow: bool = False):
    """Upstream's synthetic model in float64 (cached): the reference the stream tests decode with."""
    if (name, narrow) not in _UPSTREAM:
        _UPSTREAM[name, narrow] = synthetic_model(name, **NARROW if narrow else {}).double()
    return _UPSTREAM[name, narrow]


def engine64(name: str, streams: int = 4, narrow: bool = False, **options) -> StreamEngine:
    """A float64 stream engine over :func:`upstream64` (torch ops: fast and exact on the CPU)."""
    config = {**published_config(name), **(NARROW if narrow else {})}
    return StreamEngine(upstream64(name, narrow), config, streams, dtype=torch.float64, **options)


def frames_of(codes: list[torch.Tensor], strides: list[int], start: int, stop: int, row: int = 0) -> list[torch.Tensor]:
    """Coarse frames [start, stop) of row ``row`` of ``codes``: per level [1, L_i]."""
    return [c[row:row + 1, start * strides[0] // s:stop * strides[0] // s] for c, s in zip(codes, strides)]


# --- kernel tests (tests/ops, test_modules): shapes of the published decoders, tolerances ---------

# residual-unit channel counts of the three published decoders (24 kHz; 32 and 44 kHz share theirs)
CHANNELS = [512, 256, 128, 64, 768, 384, 192, 96]


# (C_in, C_out, stride) of every decoder transposed conv: 24 kHz, then 32/44 kHz
UPSAMPLERS = [(1024, 512, 8), (512, 256, 8), (256, 128, 4), (128, 64, 2),
              (1536, 768, 8), (768, 384, 8), (384, 192, 3), (192, 96, 2)]


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # relative to output scale


def close(got, ref, dtype):
    """``got`` within the dtype's tolerance (:data:`TOL`, relative to ``ref``'s largest magnitude)."""
    assert got.shape == ref.shape, (got.shape, ref.shape)
    scale = ref.abs().max().item() + 1e-6
    err = (got.double() - ref.double()).abs().max().item()
    assert err <= TOL[dtype] * scale, f"max err {err:.3g} vs scale {scale:.3g}"


def d(t):
    """float64, passing None through."""
    return None if t is None else t.double()


def log_uniform_alpha(n, gen):
    return torch.exp(torch.empty(n).uniform_(-1.6, 1.6, generator=gen))


def channels_last(t):
    """The same values [B, C, T], laid out [B, T, C] in memory."""
    out = t.transpose(1, 2).contiguous().transpose(1, 2)
    assert is_channels_last(out)
    return out


def set_alphas(module, seed):
    """Every Snake alpha of ``module`` log-uniform in e^-1.6..e^1.6 (trained models' are not all 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if hasattr(m, "alpha"):
                m.alpha.copy_(torch.exp(torch.empty(m.alpha.shape).uniform_(-1.6, 1.6, generator=gen)))


def upstream_unit(C, dilation, seed):
    """A seeded upstream ResidualUnit (depthwise, as SNAC's decoder has them) in eval mode."""
    from snac.layers import ResidualUnit

    torch.manual_seed(seed)
    unit = ResidualUnit(C, dilation=dilation, groups=C).eval()
    set_alphas(unit, seed)
    return unit


def fused_copy(unit):
    """A fused unit with the same weights, from a fresh upstream unit (deepcopy breaks weight norm)."""
    from snac_fast.model.modules import FastSnake1d, FusedResidualUnit
    from snac_fast.model.surgery import fold_weight_norm

    twin = upstream_unit(unit.block[0].alpha.shape[1], unit.block[1].dilation[0], 0)
    twin.load_state_dict(unit.state_dict())
    for i in (0, 2):
        twin.block[i] = FastSnake1d.from_snake(twin.block[i])
    fold_weight_norm(twin)
    return FusedResidualUnit.from_unit(twin)
