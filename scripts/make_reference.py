"""Regenerate samples/reference/: what upstream snac (float32, CPU, eager) decodes from each sample
token file on its seeded synthetic checkpoint, NoiseBlock noise from a CPU generator seeded 0.

    python scripts/make_reference.py
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

import soundfile
import torch

from snac_fast.codes import load_tokens
from snac_fast.fidelity import decode_with_noise
from snac_fast.model.synthetic import state_dict_fingerprint, state_dict_sha256, synthetic_model

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "samples" / "reference"
MODELS = ["snac_24khz", "snac_32khz", "snac_44khz"]
CHECKPOINT_SEED = 0
NOISE_SEED = 0


def main() -> None:
    REFERENCE.mkdir(parents=True, exist_ok=True)
    entries = {}
    for name in MODELS:
        model = synthetic_model(name, seed=CHECKPOINT_SEED)
        codes, _ = load_tokens(ROOT / "samples" / f"{name}.pt")
        audio = decode_with_noise(model, codes, NOISE_SEED, torch.device("cpu"))[0, 0].numpy()
        wav = REFERENCE / f"{name}.wav"
        soundfile.write(str(wav), audio, model.sampling_rate, subtype="FLOAT")
        entries[wav.name] = {
            "tokens": f"samples/{name}.pt",
            "model": f"synthetic:{name}",
            "checkpoint_seed": CHECKPOINT_SEED,
            "checkpoint_sha256": state_dict_sha256(model.state_dict()),  # exact, on the machine that made it
            "checkpoint_fingerprint": state_dict_fingerprint(model.state_dict()),  # checked, 1e-6 relative
            "noise_seed": NOISE_SEED,
            "noise": "CPU torch.Generator, float32 randn per NoiseBlock in call order (snac_fast.model.noise.seeded_noise)",
            "sampling_rate": model.sampling_rate,
            "samples": int(audio.size),
            "wav_sha256": hashlib.sha256(wav.read_bytes()).hexdigest(),
        }
        print(f"{wav.name}: {audio.size} samples, rms {float((audio ** 2).mean() ** 0.5):.4f}")
    manifest = {"decoder": "upstream snac, float32, CPU, eager", "torch": torch.__version__,
                "snac": importlib.metadata.version("snac"), "files": entries}
    (REFERENCE / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


if __name__ == "__main__":
    main()
