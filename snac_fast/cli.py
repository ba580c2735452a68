"""``snac-fast`` command line: decode and encode token files, check fidelity, profile a decode, warm
the kernel cache."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from snac_fast import options

EPILOG = """\
models: a hub id (hubertsiuzdak/snac_24khz, _32khz, _44khz), a local folder with config.json and
pytorch_model.bin, or synthetic:snac_24khz (also synthetic:snac_32khz, synthetic:snac_44khz):
seeded, UNTRAINED weights built offline with the published architecture. Synthetic models make
noise, not speech; their timing and fidelity figures are real. Model precedence: --model, then the
token file's "model" entry, then hubertsiuzdak/snac_24khz.
"""


class UsageError(Exception):
    """Bad input: reported in one line, exit code 2."""


def _add_model_args(p: argparse.ArgumentParser, with_seed: bool = False, reads_tokens: bool = False) -> None:
    p.add_argument("--model", help="hub id, local folder, or synthetic:<name> (see below)")
    if reads_tokens:
        p.add_argument("--ignore-file-model", action="store_true",
                       help="decode with --model although the token file names another model")
    p.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda if available)")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"],
                   help="compute dtype (default: float16 on cuda, float32 on cpu)")
    p.add_argument("--local-files-only", action="store_true", help="never touch the network; use the hub cache")
    if with_seed:
        p.add_argument("--seed", type=int, help="seed the decoder's noise (same seed, same audio)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="snac-fast", description="SNAC neural audio codec with Triton kernels: decode, encode, check, profile.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    from snac_fast import __version__

    parser.add_argument("--version", action="version", version=f"snac-fast {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    fmt = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("decode", help="token file -> WAV", epilog=EPILOG, formatter_class=fmt,
                       description="Decode a token file (torch.save of the codes list, or a dict with 'codes' and 'model') to a WAV at the model's rate.")
    p.add_argument("tokens", type=Path, help="token file (.pt)")
    p.add_argument("out", type=Path, help="output audio: .wav (float32 by default), .flac (PCM_16) or .ogg (Vorbis)")
    p.add_argument("--subtype", help="sample format of the output (soundfile's names: PCM_16, PCM_24, FLOAT, ...)")
    _add_model_args(p, with_seed=True, reads_tokens=True)

    p = sub.add_parser("encode", help="audio file -> token file", epilog=EPILOG, formatter_class=fmt,
                       description="Encode any soundfile-readable audio: mixed to mono, resampled to the model's rate; writes {'codes', 'model'}.")
    p.add_argument("audio", type=Path, help="input audio (WAV, FLAC, OGG, ...)")
    p.add_argument("tokens", type=Path, help="output token file (.pt)")
    _add_model_args(p)

    p = sub.add_parser("fidelity", help="check a decode against the original model", epilog=EPILOG, formatter_class=fmt,
                       description="Decode TOKENS with snac-fast and with the original upstream model (float32, same weights, "
                                   "same noise) and with plain upstream at the same dtype; print SNR, max error, log-mel "
                                   "distance. Exit code 1 when the check fails.")
    p.add_argument("tokens", type=Path, help="token file (.pt)")
    _add_model_args(p, reads_tokens=True)
    p.add_argument("--seed", type=int, default=0, help="noise seed shared by all decodes (default 0)")
    p.add_argument("--no-baseline", action="store_true", help="skip the plain-upstream decode at the fast dtype")
    p.add_argument("--json", action="store_true", help="print the report as JSON")

    p = sub.add_parser("profile", help="per-layer decode timing, fast vs original", epilog=EPILOG, formatter_class=fmt,
                       description="Time every decoder layer (CUDA events on a GPU, wall clock on CPU), median of --runs "
                                   "runs after warm-up, for snac-fast and the original upstream model.")
    p.add_argument("tokens", type=Path, help="token file (.pt)")
    _add_model_args(p, reads_tokens=True)
    p.add_argument("--runs", type=int, default=10, help="timed runs per model (default 10)")
    p.add_argument("--original-dtype", choices=["float16", "bfloat16", "float32"],
                   help="dtype of the original model (default: the fast model's)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", type=Path, help="write a bar chart PNG (needs matplotlib: pip install snac-fast[plot])")

    p = sub.add_parser("warmup", help="compile and cache the kernels a server needs", epilog=EPILOG, formatter_class=fmt,
                       description="Compile every Triton kernel that decodes of the given batch sizes and frame counts "
                                   "(and, with --streams, the stream engine's steps) launch, concurrently, into Triton's "
                                   "persistent cache (TRITON_CACHE_DIR, default ~/.triton/cache): run it in a container "
                                   "build, ship the cache, and a new process decodes without compiling. Needs a GPU.")
    _add_model_args(p)
    p.add_argument("--batch", default="1", help="comma-separated batch sizes (default 1)")
    p.add_argument("--frames", default="4", help="comma-separated coarse frame counts per decode (default 4)")
    p.add_argument("--streams", type=int, default=0, help="also warm the stream engine for up to N streams")

    p = sub.add_parser("encode-dataset", help="folder / list / manifest / WebDataset tars of audio -> Parquet code shards",
                       epilog=EPILOG, formatter_class=fmt,
                       description="Encode every input of SRC (a folder, recursive; a .txt list of paths; a .parquet/.jsonl "
                                   "manifest with a path or audio column; WebDataset .tar shards or a glob of them) into "
                                   "OUT/shard-*.parquet: id, path, duration, sampling_rate, model, codes_0.., the carried "
                                   "--columns, with --format orpheus orpheus_ids (and input_ids, labels, attention_mask "
                                   "with --tokenizer), error. Unreadable files become rows with an error; a repeated run "
                                   "skips finished shards (resume).")
    p.add_argument("src", help="folder, .txt list, .parquet/.jsonl manifest, or .tar shards (a quoted glob)")
    p.add_argument("out", type=Path, help="output folder for the shards")
    _add_model_args(p)
    from snac_fast.datasets.runs import EncodeSettings

    options.add_arguments(p, EncodeSettings)

    p = sub.add_parser("decode-dataset", help="Parquet code shards -> audio files or Parquet",
                       epilog=EPILOG, formatter_class=fmt,
                       description="Decode the code shards of SRC (a shard or a folder of them) to one file per row, named after "
                                   "its source with the extension replaced (a.flac -> OUT/a.wav) and cut to the source's "
                                   "length, or to Parquet shards with an audio column; rows with an error go to "
                                   "OUT/_errors.jsonl.")
    p.add_argument("src", type=Path, help="a shard file or a folder of shards")
    p.add_argument("out", type=Path, help="output folder")
    _add_model_args(p)
    p.add_argument("--format", choices=["wav", "flac", "parquet"], default="wav", help="output (default wav)")
    p.add_argument("--seed", type=int, default=0, help="noise seed of every row's decode (default 0)")
    _add_serve_parser(sub, fmt)
    return parser


def _add_serve_parser(sub, fmt) -> None:
    from snac_fast.serve.settings import add_arguments

    p = sub.add_parser("serve", help="HTTP/WebSocket server: Orpheus-style TTS audio, batched across connections",
                       epilog=EPILOG, formatter_class=fmt,
                       description="POST /v1/audio/speech (OpenAI's speech API) asks the language model at --lm-url "
                                   "(an OpenAI-compatible completions server: vLLM, SGLang, llama.cpp, LM Studio) for "
                                   "audio tokens and streams PCM back; WS /v1/audio/stream takes token ids; /health, "
                                   "/metrics. Needs: pip install 'snac-fast[serve]'.")
    add_arguments(p)  # one flag per ServeSettings field, with its default


def cmd_serve(args: argparse.Namespace) -> int:
    from snac_fast.serve.settings import ServeSettings

    settings = ServeSettings.from_arguments(args)  # checked: a bad value is a ValueError, exit 2
    try:
        import aiohttp  # noqa: F401
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UsageError(f"serve needs its extra: pip install 'snac-fast[serve]' ({e})") from None
    from snac_fast.serve.engine.client import EngineLostError
    from snac_fast.serve.run import serve
    from snac_fast.serve.workers import ServeFailure

    try:
        serve(settings)
    except (EngineLostError, ServeFailure) as e:  # logged as it happened; the status tells a supervisor to restart
        print(f"snac-fast serve: error: {e}", file=sys.stderr)
        return 1
    return 0


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UsageError(f"{name} must list integers >= 1, got {text!r}")
    return values


def _check_device(device: str | None) -> None:
    """A --device torch cannot parse, named in one line before any model loads."""
    if device is None:
        return
    import torch

    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"--device must be cpu, cuda or cuda:N, got {device!r}") from None


def _load_model(args: argparse.Namespace, file_model: str | None, **options):
    from snac_fast.api import load_codec

    _check_device(args.device)
    if args.model and file_model and args.model != file_model and not getattr(args, "ignore_file_model", False):
        raise UsageError(f"{args.tokens} was encoded with {file_model}, not --model {args.model}: another model "
                         "decodes it to wrong audio (pass --ignore-file-model to do it anyway)")
    return load_codec(args.model or file_model, device=args.device, dtype=args.dtype,
                      local_files_only=args.local_files_only, **options)


class _Stages:
    """A tqdm bar over named steps (on a terminal only); cleared on exit, errors included."""

    def __init__(self, names: list[str]) -> None:
        from tqdm import tqdm

        self._names = iter(names)
        self._bar = tqdm(total=len(names), desc=next(self._names), unit="step", file=sys.stderr, leave=False, disable=None)

    def next(self) -> None:
        self._bar.update()
        self._bar.set_description(next(self._names, "done"))

    def __enter__(self) -> "_Stages":
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()


# output extension -> (soundfile format, default subtype)
AUDIO_FORMATS = {".wav": ("WAV", "FLOAT"), ".flac": ("FLAC", "PCM_16"), ".ogg": ("OGG", "VORBIS")}


def _audio_output(path: Path, subtype: str | None) -> tuple[str, str]:
    """(format, subtype) for an output audio path, checked before any work: a known extension, a
    folder that exists, a subtype the format can hold."""
    import soundfile

    known = AUDIO_FORMATS.get(path.suffix.lower())
    if known is None:
        raise UsageError(f"cannot write {path}: unknown audio format {path.suffix or '(no extension)'!r}; "
                         f"name it {', '.join(AUDIO_FORMATS)}")
    _check_folder(path)
    subtype = (subtype or known[1]).upper()
    if not soundfile.check_format(known[0], subtype):
        raise UsageError(f"cannot write {path}: {path.suffix} cannot hold {subtype} samples; choose one of "
                         f"{', '.join(sorted(soundfile.available_subtypes(known[0])))}")
    return known[0], subtype


def _check_folder(path: Path) -> None:
    if not path.parent.is_dir():
        raise UsageError(f"cannot write {path}: the folder {path.parent} does not exist")


def cmd_decode(args: argparse.Namespace) -> None:
    import soundfile

    from snac_fast.codes import load_tokens
    from snac_fast.runtime.warmup import compile_kernels

    audio_format, subtype = _audio_output(args.out, args.subtype)
    codes, file_model = load_tokens(args.tokens)
    if codes[0].dim() == 2 and codes[0].shape[0] != 1:
        raise UsageError(f"{args.tokens} holds a batch of {codes[0].shape[0]}; the CLI writes one WAV, decode batches from Python")
    with _Stages(["loading model", "decoding", "writing"]) as stages:
        # one decode: a CUDA graph's capture would cost more than it saves; the kernels still compile concurrently
        model = _load_model(args, file_model, cuda_graphs=False)
        stages.next()
        compile_kernels(model, [(1, codes[0].shape[-1])])
        audio = model.decode(codes, seed=args.seed)
        stages.next()
        samples = audio[0, 0].float().cpu().numpy()
        try:
            soundfile.write(str(args.out), samples, model.sampling_rate, format=audio_format, subtype=subtype)
        except (OSError, RuntimeError, soundfile.LibsndfileError) as e:
            raise UsageError(f"cannot write {args.out}: {e}") from e
        stages.next()
    print(f"{args.out}: {samples.size} samples at {model.sampling_rate} Hz ({samples.size / model.sampling_rate:.2f} s)")


def cmd_encode(args: argparse.Namespace) -> None:
    import soundfile

    from snac_fast.codes import read_mono, resample_mono, save_tokens

    if args.audio.is_dir():
        raise UsageError(f"cannot read audio {args.audio}: it is a directory (encode-dataset takes folders)")
    if not args.audio.is_file():
        raise UsageError(f"cannot read audio {args.audio}: no such file")
    _check_folder(args.tokens)  # before the encode, not after it
    with _Stages(["reading", "loading model", "encoding", "writing"]) as stages:
        try:
            channels = soundfile.info(str(args.audio)).channels
            mono, rate = read_mono(str(args.audio))
        except (OSError, RuntimeError, soundfile.LibsndfileError) as e:
            raise UsageError(f"cannot read audio {args.audio}: {e}") from e
        except ValueError as e:
            raise UsageError(f"{args.audio} {e}") from e
        stages.next()
        model = _load_model(args, None)
        stages.next()
        if channels > 1:
            print(f"{args.audio}: mixed {channels} channels down to mono", file=sys.stderr)
        if rate != model.sampling_rate:
            print(f"{args.audio}: resampled from {rate} Hz to the model's {model.sampling_rate} Hz", file=sys.stderr)
        mono = resample_mono(mono, rate, model.sampling_rate)
        codes = model.encode(mono.view(1, 1, -1), cuda_graphs=False)  # one encode: a capture would cost more
        stages.next()
        save_tokens(args.tokens, codes, model=model.source)
        stages.next()
    print(f"{args.tokens}: {len(codes)} levels, lengths {[c.shape[1] for c in codes]}, model {model.source}")


def cmd_fidelity(args: argparse.Namespace) -> int:
    from snac_fast.codes import load_tokens

    codes, file_model = load_tokens(args.tokens)
    model = _load_model(args, file_model)
    report = model.check_fidelity(codes, seed=args.seed, baseline=not args.no_baseline)
    print(report.to_json() if args.json else report)
    return 0 if report.passed else 1


def cmd_profile(args: argparse.Namespace) -> None:
    from snac_fast.api import parse_dtype
    from snac_fast.codes import load_tokens

    if args.runs < 1:
        raise UsageError("--runs must be at least 1")
    codes, file_model = load_tokens(args.tokens)
    model = _load_model(args, file_model)
    original_dtype = parse_dtype(args.original_dtype, model.device) if args.original_dtype else None
    report = model.profile(codes, runs=args.runs, original_dtype=original_dtype)
    print(report.to_json() if args.json else report)
    if args.plot:
        try:
            report.plot(str(args.plot))
        except ImportError as e:
            raise UsageError(f"--plot needs matplotlib (pip install 'snac-fast[plot]'): {e}") from e


def cmd_warmup(args: argparse.Namespace) -> None:
    batch, frames = _int_list(args.batch, "--batch"), _int_list(args.frames, "--frames")
    if args.streams < 0:
        raise UsageError("--streams must be >= 0")
    model = _load_model(args, None)
    if model.device.type != "cuda":
        raise UsageError("warmup compiles GPU kernels: run it on a machine with CUDA (or pass --device cuda)")
    times = model.warmup(batch, frames, streams=args.streams)
    cache = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    print(f"warm: {model.source} on {model.device}, batch {batch} x frames {frames}"
          + (f", {args.streams} streams" if args.streams else "") + "; "
          + ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in times.items()) + f"; kernels cached in {cache}")


def cmd_encode_dataset(args: argparse.Namespace) -> None:
    from snac_fast.datasets import encode_dataset
    from snac_fast.datasets.runs import EncodeSettings

    _check_device(args.device)
    # the inputs are listed (and refused) before the model loads: here, or in each Ray actor
    try:
        settings = options.from_arguments(EncodeSettings, args).check()
    except ValueError as e:  # said with the flags' names
        raise UsageError(options.as_flags(EncodeSettings, str(e)).replace("--format='orpheus'", "--format orpheus")) from None
    summary = encode_dataset(args.src, args.out, settings=settings, model=args.model, device=args.device,
                             dtype=args.dtype, model_options={"local_files_only": args.local_files_only})
    print(f"{args.out}: {summary['files']} files in {summary['shards']} shards ({summary['shards_skipped']} already done), "
          f"{summary['audio_seconds'] / 3600:.3f} h of audio, {summary['errors']} errors, {summary['wall_seconds']:.1f} s")


def cmd_decode_dataset(args: argparse.Namespace) -> None:
    from snac_fast.datasets import decode_dataset

    _check_device(args.device)
    summary = decode_dataset(args.src, args.out, model=args.model, device=args.device, dtype=args.dtype,
                             model_options={"local_files_only": args.local_files_only}, format=args.format,
                             seed=args.seed)
    print(f"{args.out}: {summary['written']} written, {summary['skipped']} already there, {summary['errors']} errors "
          f"(listed in {args.out / '_errors.jsonl'}), {summary['wall_seconds']:.1f} s")


COMMANDS = {"decode": cmd_decode, "encode": cmd_encode, "fidelity": cmd_fidelity, "profile": cmd_profile,
            "warmup": cmd_warmup, "encode-dataset": cmd_encode_dataset, "decode-dataset": cmd_decode_dataset,
            "serve": cmd_serve}


# one-shot commands that leave nothing running and every file closed when they return
EXIT_AT_ONCE = frozenset({"decode", "encode"})


def main(argv: list[str] | None = None, exit_at_once: bool = False) -> int:
    """Run a command; returns the exit status. ``exit_at_once`` (the console script): after decode
    and encode, end the process without tearing down the CUDA context and the interpreter's
    modules, which costs most of a second after the work is done (docs/measurements.md)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status = int(COMMANDS[args.command](args) or 0)
    except (UsageError, ValueError, OSError, ImportError) as e:  # bad input or a missing extra: one line, no traceback
        print(f"snac-fast {args.command}: error: {e}", file=sys.stderr)
        status = 2
    if exit_at_once and args.command in EXIT_AT_ONCE:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def entry() -> None:
    """The ``snac-fast`` console script."""
    sys.exit(main(exit_at_once=True))


if __name__ == "__main__":
    entry()
