"""The snac-fast command line, end to end in subprocesses."""

import sys

import numpy as np
import pytest
import soundfile
import torch
from helpers import ROOT, cli

from snac_fast import FastSNAC, load_tokens
from snac_fast.metrics import snr_db

SAMPLE_24 = ROOT / "samples" / "snac_24khz.pt"


def assert_usage_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("snac-fast") and "error:" in last
    for f in fragments:
        assert f in last, last


def test_help_explains_commands_and_synthetic_models():
    proc = cli("--help")
    assert proc.returncode == 0
    for word in ("decode", "encode", "synthetic:snac_24khz", "UNTRAINED"):
        assert word in proc.stdout
    decode_help = cli("decode", "--help").stdout
    for word in ("--model", "--device", "--dtype", "--seed"):
        assert word in decode_help


@pytest.mark.heavy
def test_decode_sample_writes_wav(tmp_path):
    out = tmp_path / "out.wav"
    proc = cli("decode", SAMPLE_24, out, "--seed", "0", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    data, rate = soundfile.read(str(out), dtype="float32")
    codes, model = load_tokens(SAMPLE_24)
    assert model == "synthetic:snac_24khz"
    assert rate == 24000 and data.ndim == 1 and data.shape[0] == codes[-1].shape[1] * 512
    # --seed 0 is decode(seed=0): the same audio as the API (here through the interpreted kernels)
    expected = FastSNAC.from_pretrained(model, device="cpu").decode(codes, seed=0)[0, 0]
    assert snr_db(expected, torch.from_numpy(data)) >= 100


def test_decode_writes_flac_and_ogg(tmp_path):
    """The same seed in three formats: FLAC holds the WAV's float samples to 16 bits, Ogg Vorbis
    (lossy) the same length."""
    for name in ("out.wav", "out.flac", "out.ogg"):
        proc = cli("decode", SAMPLE_24, tmp_path / name, "--seed", "0", "--device", "cpu")
        assert proc.returncode == 0, proc.stderr
    wav, _ = soundfile.read(str(tmp_path / "out.wav"), dtype="float64")
    flac, rate = soundfile.read(str(tmp_path / "out.flac"), dtype="float64")
    assert soundfile.info(str(tmp_path / "out.flac")).subtype == "PCM_16" and rate == 24000
    assert flac.shape == wav.shape and np.abs(flac - wav).max() <= 1.01 / 32767
    ogg, _ = soundfile.read(str(tmp_path / "out.ogg"), dtype="float64")
    assert ogg.shape == wav.shape


def test_encode_then_decode_uses_the_files_model(tmp_path):
    rng = np.random.default_rng(0)
    t = np.arange(int(0.3 * 16000)) / 16000
    stereo = np.stack([np.sin(2 * np.pi * 220 * t), 0.1 * rng.standard_normal(t.size)], axis=1).astype(np.float32)
    wav = tmp_path / "in.wav"
    soundfile.write(str(wav), stereo, 16000)  # 16 kHz stereo: mixed to mono, resampled to 32 kHz
    tokens = tmp_path / "t.pt"
    proc = cli("encode", wav, tokens, "--model", "synthetic:snac_32khz", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    codes, model = load_tokens(tokens)
    assert model == "synthetic:snac_32khz" and len(codes) == 4
    # 0.3 s at 32 kHz = 9,600 samples, padded to a multiple of hop 384 x lcm(8, 32) = 12,288
    assert [c.shape for c in codes] == [torch.Size([1, n]) for n in (4, 8, 16, 32)]
    out = tmp_path / "out.wav"
    proc = cli("decode", tokens, out, "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    info = soundfile.info(str(out))
    assert info.samplerate == 32000 and info.frames == 32 * 384


def test_dataset_commands_round_trip(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    t = np.arange(int(0.4 * 24000)) / 24000
    soundfile.write(str(corpus / "one.wav"), (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), 24000)
    (corpus / "broken.wav").write_bytes(b"not a wav")
    proc = cli("encode-dataset", corpus, tmp_path / "codes", "--model", "synthetic:snac_24khz", "--device", "cpu",
               "--files-per-shard", "1")
    assert proc.returncode == 0, proc.stderr
    assert "2 files in 2 shards (0 already done)" in proc.stdout and "1 errors" in proc.stdout
    proc = cli("decode-dataset", tmp_path / "codes", tmp_path / "audio", "--device", "cpu")  # the shards name the model
    assert proc.returncode == 0, proc.stderr
    assert "1 written" in proc.stdout and soundfile.info(str(tmp_path / "audio" / "one.wav")).samplerate == 24000
    assert_usage_error(cli("encode-dataset", tmp_path / "nowhere", tmp_path / "x", "--device", "cpu"), "does not exist")
    assert_usage_error(cli("encode-dataset", corpus, tmp_path / "x", "--files-per-shard", "0"), "--files-per-shard")


def test_a_model_flag_that_disagrees_with_the_file_is_refused_unless_forced(tmp_path):
    proc = cli("decode", SAMPLE_24, tmp_path / "x.wav", "--model", "synthetic:snac_32khz", "--device", "cpu")
    assert_usage_error(proc, "was encoded with synthetic:snac_24khz, not --model synthetic:snac_32khz",
                       "--ignore-file-model")
    assert not (tmp_path / "x.wav").exists()
    proc = cli("decode", SAMPLE_24, tmp_path / "x.wav", "--model", "synthetic:snac_32khz", "--device", "cpu",
               "--ignore-file-model")
    assert_usage_error(proc, "4 code levels")  # forced: the codes themselves do not fit that model
    proc = cli("fidelity", SAMPLE_24, "--model", "synthetic:snac_44khz", "--device", "cpu")
    assert_usage_error(proc, "was encoded with synthetic:snac_24khz")


@pytest.mark.parametrize("make_args, fragments", [
    (lambda d: ["decode", d / "missing.pt", d / "o.wav"], ["does not exist"]),
    (lambda d: ["decode", d / "junk.pt", d / "o.wav"], ["cannot read token file"]),
    (lambda d: ["encode", d / "junk.pt", d / "t.pt", "--model", "synthetic:snac_24khz"], ["cannot read audio"]),
    (lambda d: ["decode", SAMPLE_24, d / "o.wav", "--model", "synthetic:nope", "--ignore-file-model"], ["unknown SNAC model"]),
    (lambda d: ["decode", SAMPLE_24, d / "o.wav", "--model", str(d), "--ignore-file-model"], ["no config.json"]),
    (lambda d: ["decode", SAMPLE_24, d / "no" / "dir" / "o.wav", "--device", "cpu"], ["cannot write", "does not exist"]),
    (lambda d: ["decode", SAMPLE_24, d / "out", "--device", "cpu"], ["unknown audio format", ".wav, .flac, .ogg"]),
    (lambda d: ["decode", SAMPLE_24, d / "o.flac", "--subtype", "FLOAT"], [".flac cannot hold FLOAT", "PCM_16"]),
    (lambda d: ["encode", d / "missing.wav", d / "t.pt"], ["cannot read audio", "no such file"]),
    (lambda d: ["encode", d / "junk.pt", d / "no" / "t.pt"], ["cannot write", "does not exist"]),
    (lambda d: ["decode", SAMPLE_24, d / "o.wav", "--device", "banana"], ["--device must be", "'banana'"]),
    (lambda d: ["decode", d, d / "o.wav"], ["is a directory"]),
    (lambda d: ["encode", d, d / "t.pt"], ["is a directory", "encode-dataset"]),
    (lambda d: ["encode-dataset", d, d / "out", "--device", "banana"], ["--device must be"]),
    (lambda d: ["serve", "--port", "99999"], ["--port must be 1-65535"]),
    (lambda d: ["serve", "--device", "banana"], ["--device must be"]),
    (lambda d: ["serve", "--voice", "alloy", "--lm-preset", "orpheus"], ["--voice 'alloy' is not one of the orpheus preset"]),
    (lambda d: ["serve", "--voice", "alloy", "--voices", "tara,leo"], ["--voice 'alloy' is not one of --voices"]),
    (lambda d: ["serve", "--api-key", " "], ["--api-key must not be empty"]),
])
def test_bad_input_exits_2_with_one_line(tmp_path, make_args, fragments):
    (tmp_path / "junk.pt").write_bytes(b"junk")
    assert_usage_error(cli(*make_args(tmp_path)), *fragments)


def test_version_and_serve_help_with_its_defaults():
    from snac_fast import __version__

    version = cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"snac-fast {__version__}"
    serve_help = " ".join(cli("serve", "--help").stdout.split())  # argparse wraps lines at the terminal's width
    for flag, default in (("--port", "8880"), ("--max-batch", "256"), ("--idle-timeout", "60.0"),
                          ("--voice", "the preset's"), ("--lookahead", "exact"), ("--max-input-chars", "20000")):
        assert flag in serve_help and f"(default: {default})" in serve_help, flag
    assert "SNAC_FAST_API_KEY" in serve_help
    from snac_fast.serve.lm.presets import PRESETS  # every preset named in --lm-preset's help

    assert all(name in serve_help for name in PRESETS) and "--lm-preset" in serve_help


@pytest.mark.heavy
def test_encode_says_what_it_resampled_and_mixed_down(tmp_path):
    stereo = tmp_path / "stereo.wav"
    soundfile.write(str(stereo), np.zeros((16000, 2), np.float32), 16000)
    proc = cli("encode", stereo, tmp_path / "t.pt", "--model", "synthetic:snac_24khz", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "mixed 2 channels down to mono" in proc.stderr and "resampled from 16000 Hz to the model's 24000 Hz" in proc.stderr
    mono = tmp_path / "mono.wav"
    soundfile.write(str(mono), np.zeros(24000, np.float32), 24000)
    quiet = cli("encode", mono, tmp_path / "m.pt", "--model", "synthetic:snac_24khz", "--device", "cpu")
    assert quiet.returncode == 0 and "resampled" not in quiet.stderr and "mixed" not in quiet.stderr


def test_unknown_dtype_is_an_argparse_error(tmp_path):
    proc = cli("decode", SAMPLE_24, tmp_path / "o.wav", "--dtype", "float8")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


@pytest.fixture
def short_tokens(tmp_path):
    """Two frames for a narrow 24 kHz checkpoint (helpers.NARROW) in a folder the file names: the
    commands' plumbing is under test, not the model's widths."""
    from helpers import NARROW, random_codes

    from snac_fast import save_tokens
    from snac_fast.configs import published_config
    from snac_fast.model.synthetic import make_checkpoint

    folder = make_checkpoint(tmp_path / "narrow", "snac_24khz", **NARROW)
    path = tmp_path / "short.pt"
    save_tokens(path, random_codes(published_config("snac_24khz"), 2), model=str(folder))
    return path


def test_fidelity_command(short_tokens):
    import json

    proc = cli("fidelity", short_tokens, "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "fidelity: PASS" in proc.stdout and "SNR" in proc.stdout
    proc = cli("fidelity", short_tokens, "--device", "cpu", "--json", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["passed"] is True and data["seed"] == 3 and data["fast_dtype"] == "float32"
    assert data["snr_db"] >= 100 and data["max_abs_error"] <= 1e-5  # float32 on CPU: the same arithmetic


def test_fidelity_command_exits_1_on_failure(short_tokens, monkeypatch, capsys):
    from snac_fast import FastSNAC
    from snac_fast import cli as cli_module
    from snac_fast.fidelity import FidelityReport, judge

    def failing(self, codes, **kwargs):
        r = FidelityReport(snr_db=10.0, max_abs_error=0.5, rms_fast=0.1, rms_reference=0.1, log_mel_distance_db=3.0,
                           baseline_snr_db=None, fast_dtype="float32", fast_device="cpu", reference_dtype="float32",
                           reference_device="cpu", seed=0, samples=1)
        judge(r, torch.float32)
        return r

    monkeypatch.setattr(FastSNAC, "check_fidelity", failing)
    assert cli_module.main(["fidelity", str(short_tokens), "--device", "cpu"]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.heavy
def test_profile_command(short_tokens, tmp_path):
    import json

    png = tmp_path / "profile.png"
    proc = cli("profile", short_tokens, "--device", "cpu", "--runs", "1", "--json", "--plot", png)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert any(r["name"] == "decoder.model.6" for r in data["layers"]) and png.stat().st_size > 1000
    proc = cli("profile", short_tokens, "--device", "cpu", "--runs", "1")
    assert proc.returncode == 0 and "untimed decode" in proc.stdout
    assert_usage_error(cli("profile", short_tokens, "--runs", "0"), "--runs")


def test_dataset_commands_name_their_extra_when_pyarrow_is_missing(tmp_path, monkeypatch, capsys):
    """Without pyarrow: one line naming the extra, before any model loads or file is listed."""
    from snac_fast import cli as cli_module

    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    for args in (["encode-dataset", str(tmp_path), str(tmp_path / "out"), "--model", "synthetic:nope"],
                 ["decode-dataset", str(tmp_path), str(tmp_path / "audio")]):
        assert cli_module.main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "pip install 'snac-fast[datasets]'" in err[0], err


@pytest.mark.parametrize("missing", ["aiohttp", "starlette", "uvicorn", "prometheus_client"])
def test_serve_names_its_extra_when_a_package_is_missing(monkeypatch, capsys, missing):
    """Without one of the [serve] extra's packages: one line naming the extra, exit 2."""
    from snac_fast import cli as cli_module

    monkeypatch.setitem(sys.modules, missing, None)
    assert cli_module.main(["serve", "--lm-url", "http://127.0.0.1:9/v1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'snac-fast[serve]'" in err[0] and missing in err[0], err
