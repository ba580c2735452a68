"""Regenerate samples/: speech synthesized with espeak-ng, encoded by each synthetic checkpoint.

    python scripts/make_samples.py            # needs espeak-ng on PATH (apt-get install espeak-ng)
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import soundfile
import torch
import torchaudio.functional as AF

from snac_fast.codes import save_tokens
from snac_fast.model.synthetic import synthetic_model

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
TEXT = "The quick brown fox jumps over the lazy dog. Fast codecs keep speech servers responsive."
MODELS = ["snac_24khz", "snac_32khz", "snac_44khz"]
SECONDS = 1.5  # clip length: small files and CPU-friendly tests, still many frames per decoder block
# coarse frames kept of the 32/44 kHz codes (a prefix, whole attention windows): the CPU tests decode
# these files through Triton's interpreter with full-width models, which costs ~2 s per 1,000 samples
KEEP_FRAMES = {"snac_32khz": 8, "snac_44khz": 12}


def speak(text: str) -> tuple[torch.Tensor, int]:
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "speech.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-s", "160", "-w", str(wav), text], check=True)
        data, rate = soundfile.read(str(wav), dtype="float32", always_2d=True)
    return torch.from_numpy(data).mean(dim=1), rate


def main() -> None:
    speech, rate = speak(TEXT)
    SAMPLES.mkdir(exist_ok=True)
    for name in MODELS:
        model = synthetic_model(name, seed=0)
        audio = AF.resample(speech, rate, model.sampling_rate)[: int(SECONDS * model.sampling_rate)]
        with torch.inference_mode():
            codes = model.encode(audio.view(1, 1, -1))
        if name in KEEP_FRAMES:
            frames, coarse = KEEP_FRAMES[name], codes[0].shape[1]
            codes = [c[:, :c.shape[1] * frames // coarse] for c in codes]
        path = SAMPLES / f"{name}.pt"
        save_tokens(path, codes, model=f"synthetic:{name}")
        print(f"{path.name}: lengths {[c.shape[1] for c in codes]}")


if __name__ == "__main__":
    main()
