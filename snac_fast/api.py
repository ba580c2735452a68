"""FastSNAC: upstream SNAC with snac-fast's surgery applied, behind upstream's encode/decode contracts."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from snac_fast.codes import validate_audio, validate_codes, validate_lengths
from snac_fast.configs import DEFAULT_MODEL
from snac_fast.encoding import GraphedEncode, encode_padded, encoder_reach, padding_unit
from snac_fast.model.loading import Checkpoint, build_upstream, resolve_checkpoint
from snac_fast.model.noise import check_seed, injected_noise, keyed_noise
from snac_fast.model.surgery import SurgeryReport, accelerate
from snac_fast.ops.device import device_scope
from snac_fast.ops.warm_start import finish_runtime_warmup, start_runtime_warmup
from snac_fast.runtime.graphs import GraphedDecode

DTYPE_NAMES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def parse_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """float16 on CUDA and float32 on CPU unless named; accepts torch dtypes and their names."""
    if dtype is None:
        return torch.float16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {dtype!r}; use float16, bfloat16 or float32")
        dtype = DTYPE_NAMES[dtype]
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    return dtype


class FastSNAC:
    """A SNAC codec whose decoder (and encoder) Snake1d run snac-fast's Triton kernels.

    Build with :meth:`from_pretrained`, or wrap a ``snac.SNAC`` you already have (its weights are
    used as they are; it is modified in place). ``model`` is the upstream module tree after surgery.
    """

    # encodes of up to this many samples (batch x chunk length; 175 s at 24 kHz) replay CUDA graphs:
    # an eager encode's ~100 launches cost more host time than a 60 s encode's GPU time; past it
    # launches are amortised and a graph's memory pool is not worth keeping (docs/measurements.md)
    encode_graph_samples = 1 << 22

    def __init__(
        self,
        model: nn.Module,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        accelerate_encoder: bool = True,
        fuse: bool = True,
        cuda_graphs: bool | None = None,
        max_graphs: int = 8,
        config: dict | None = None,
        source: str | None = None,
        reference_factory: Callable[[], nn.Module] | None = None,
    ) -> None:
        self.device = torch.device(device) if device is not None else default_device()
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device} requested but CUDA is not available; use device='cpu'")
        start_runtime_warmup(self.device)
        self.dtype = parse_dtype(dtype, self.device)
        self.config = dict(config) if config is not None else _config_of(model)
        self.source = source
        if reference_factory is None:  # keep the original weights to rebuild the reference model on demand
            state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            snapshot = Checkpoint.in_memory(source or "in-memory model", self.config, state)
            reference_factory = lambda: build_upstream(snapshot)  # noqa: E731
        self._reference_factory = reference_factory
        # the fused modules' weights are versioned (no inference tensors); kernels run on the model's device
        with torch.inference_mode(False), device_scope(self.device):
            _own_inference_tensors(model)
            self.report: SurgeryReport = accelerate(model, encoder=accelerate_encoder, fuse=fuse,
                                                    device=self.device, dtype=self.dtype)
        self.model = model.eval()
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and fuse
        if cuda_graphs and (self.device.type != "cuda" or not fuse):
            raise ValueError("cuda_graphs=True needs a CUDA device and fuse=True")
        self.graphs = GraphedDecode(self.model, self.device, max_graphs=max_graphs) if cuda_graphs else None
        self.encode_graphs = GraphedEncode(self.model, self.device, max_graphs=max_graphs) if cuda_graphs else None
        self.lock = threading.RLock()  # decodes and stream steps patch the model's noise and share graph buffers
        self._stream_engines: dict = {}
        self._layers = None  # a CPU's decoder as layers with state (_layer_decoder), built at its first decode
        finish_runtime_warmup()

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike | Checkpoint,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        token: str | bool | None = None,
        accelerate_encoder: bool = True,
        fuse: bool = True,
        cuda_graphs: bool | None = None,
        max_graphs: int = 8,
    ) -> "FastSNAC":
        """Load a published SNAC ("hubertsiuzdak/snac_24khz", _32khz, _44khz), a local folder with
        config.json + pytorch_model.bin (or model.safetensors), or ``synthetic:snac_24khz`` (seeded,
        untrained weights built offline). Defaults: CUDA if available, float16 there, float32 on CPU;
        fused decoder kernels; CUDA graphs on CUDA (one per codes shape, at most ``max_graphs``).
        ``name_or_path`` may also be a :class:`snac_fast.model.loading.Checkpoint` that
        :func:`snac_fast.model.loading.resolve_checkpoint` found (no second lookup; the hub options
        then must stay unset). Raises :class:`snac_fast.model.loading.CheckpointError` (a ValueError)
        saying what to do."""
        if isinstance(name_or_path, Checkpoint):
            if (revision, cache_dir, local_files_only, token) != (None, None, False, None):
                raise ValueError("revision, cache_dir, local_files_only and token locate a checkpoint: "
                                 "pass them to resolve_checkpoint, not with a resolved one")
            checkpoint = name_or_path
        else:
            checkpoint = resolve_checkpoint(name_or_path, revision=revision, cache_dir=cache_dir,
                                            local_files_only=local_files_only, token=token)
        if torch.cuda.is_available():  # CUDA and Triton warm up while the model is built on the CPU
            start_runtime_warmup(torch.device(device) if device is not None else default_device())
        with torch.inference_mode(False):  # servers build models inside inference_mode
            model = build_upstream(checkpoint)
        return cls(model, device=device, dtype=dtype, accelerate_encoder=accelerate_encoder, fuse=fuse,
                   cuda_graphs=cuda_graphs, max_graphs=max_graphs, config=checkpoint.config, source=checkpoint.source,
                   reference_factory=lambda: build_upstream(checkpoint))

    # -- properties ----------------------------------------------------------------------------

    @property
    def sampling_rate(self) -> int:
        return int(self.config["sampling_rate"])

    @property
    def hop_length(self) -> int:
        return int(self.model.hop_length)

    @property
    def n_levels(self) -> int:
        return len(self.config["vq_strides"])

    @functools.cached_property
    def encoder_reach(self) -> int:
        """Audio samples on each side of a span that its codes depend on (the halo of a chunked
        encode; :func:`snac_fast.encoding.encoder_reach`)."""
        return encoder_reach(self.model)

    @property
    def swapped(self) -> list[str]:
        """Qualified names of the Snake1d modules replaced by FastSnake1d (decoder, then encoder)."""
        return self.report.decoder_snakes + self.report.encoder_snakes

    def reference_model(self) -> nn.Module:
        """A fresh original upstream SNAC (its own Snake1d, weight norm intact, float32, CPU)."""
        return self._reference_factory()

    def __repr__(self) -> str:
        return (f"FastSNAC(source={self.source!r}, sampling_rate={self.sampling_rate}, device={self.device}, "
                f"dtype={self.dtype}, cuda_graphs={self.graphs is not None}, "
                f"fused={len(self.report.fused_residual_units)} residual units, swapped={len(self.report.decoder_snakes)} decoder + "
                f"{len(self.report.encoder_snakes)} encoder Snake1d)")

    # -- codec ---------------------------------------------------------------------------------

    def latent_length(self, codes: list[Tensor]) -> int:
        return codes[0].shape[1] * self.config["vq_strides"][0]

    def decode(self, codes: list[Tensor], *, seed: int | None = None, generator: torch.Generator | None = None,
               reuse_output: bool = False) -> Tensor:
        """Codes -> audio [B, 1, latent_length * hop_length] in the model's dtype, on its device.

        codes: one integer tensor [B, L_i] per level (upstream's ``encode`` output), any device.
        seed: position-keyed NoiseBlock noise (row b keyed by (seed, b), see :mod:`snac_fast.model.noise`):
        the same audio with or without CUDA graphs, and the audio a :meth:`stream` with this seed
        produces; a prefix of the codes decodes to the prefix of the audio, up to the receptive
        field at its end. None draws fresh noise like upstream. generator: draw the noise from this
        torch.Generator in NoiseBlock call order instead (any device; overrides seed).
        reuse_output: with CUDA graphs, return the graph's output buffer itself (no copy); the next
        decode of the same shape overwrites it.
        """
        if generator is not None:
            seed = None
        elif seed is not None:
            seed = check_seed(seed)
        with self.lock, device_scope(self.device):
            return self._decode(codes, seed, generator, reuse_output)

    def _decode(self, codes, seed, generator, reuse_output) -> Tensor:
        if self.graphs is not None:  # checks the ids itself, without a sync before the launch
            return self.graphs(codes, generator, copy_output=not reuse_output, validate=self._validate_structure,
                               seed=seed)
        codes = [c.to(self.device, non_blocking=True) for c in validate_codes(codes, self.config)]
        layers = self._layer_decoder() if generator is None else None
        # a short decode pays the flush's extra tail: below ~3 lookaheads of audio the tree was faster
        if layers is not None and self.latent_length(codes) * self.hop_length >= 3 * layers.lookahead:
            # fresh noise: a key drawn from torch's generator, so torch.manual_seed repeats it as upstream's does
            fresh = int(torch.randint(0, 1 << 62, (), dtype=torch.int64)) if seed is None else seed
            keys = torch.zeros((4, codes[0].shape[0]), dtype=torch.int64)  # (slot, frames, seed, noise row)
            keys[2], keys[3] = fresh, torch.arange(codes[0].shape[0])
            with torch.inference_mode():
                return layers.decode(keys, self.model.quantizer.from_codes(codes))
        if generator is not None:
            noise = injected_noise(self.model, generator)
        elif seed is not None:
            noise = keyed_noise(self.model, torch.full((codes[0].shape[0],), seed, dtype=torch.int64, device=self.device))
        else:
            noise = contextlib.nullcontext()
        with torch.inference_mode(), noise:
            return self.model.decode(codes)

    def _layer_decoder(self):
        """On a CPU in float32/float64, the decoder as layers with their own state
        (:meth:`~snac_fast.streaming.layer_state.LayerStates.whole_decoder`), built at the first
        decode; None elsewhere."""
        if self.device.type != "cpu" or self.dtype not in (torch.float32, torch.float64):
            return None
        if self._layers is None:
            from snac_fast.streaming.layer_state import LayerStates

            self._layers = LayerStates.whole_decoder(self.model, self.config, self.device, self.dtype)
        return self._layers

    def warmup(self, batch_sizes: Sequence[int] = (1,), frames: Sequence[int] = (4,), streams: int = 0,
               lookahead: int | str | None = None) -> dict[str, float]:
        """Compile (concurrently) and capture everything decodes of these (batch, coarse frames)
        shapes need, and with ``streams`` > 0 the steps of the stream engine of ``lookahead``;
        kernels persist in Triton's cache (``TRITON_CACHE_DIR``). Returns seconds per phase. See
        :mod:`snac_fast.runtime.warmup`."""
        from snac_fast.runtime.warmup import warmup

        return warmup(self, batch_sizes, frames, streams, lookahead=lookahead)

    def stream_engine(self, max_streams: int = 256, *, lookahead: int | str | None = None, **options):
        """A :class:`snac_fast.streaming.StreamEngine` for many concurrent streams on this codec
        (its own state rows for ``max_streams`` streams; see :mod:`snac_fast.streaming`)."""
        from snac_fast.streaming import StreamEngine

        options.setdefault("cuda_graphs", self.graphs is not None)
        return StreamEngine(self.model, self.config, max_streams, device=self.device, dtype=self.dtype,
                            lookahead=lookahead, lock=self.lock, **options)

    def stream(self, seed: int | None = None, *, lookahead: int | str | None = None, layout=None):
        """A :class:`snac_fast.streaming.DecoderStream`: ``push(codes)`` of k >= 1 new frames returns
        the audio that is now final, ``flush()`` the rest; all of it equals ``decode(codes, seed=seed)``.
        ``lookahead``: samples of audio the output may trail the newest frame by, below the exact
        receptive field (``stream().lookahead_samples``), or ``"fp16"`` (the least whose error stays
        below an fp16 decode's): earlier first audio; each push then emits the decode of all codes so
        far up to that point, never revised (a window decode with every earlier frame as context).
        ``layout``: a token layout (:data:`snac_fast.orpheus.ORPHEUS`) for ``push_ids``.
        Streams share one engine per lookahead (:meth:`shared_stream_engine`)."""
        from snac_fast.streaming import DecoderStream

        return DecoderStream(self.shared_stream_engine(lookahead), seed, layout)

    def shared_stream_engine(self, lookahead: int | str | None = None, *, max_streams: int | None = None):
        """The engine that :meth:`stream` and :meth:`warmup` use for this ``lookahead``: 256 stream
        slots, or ``max_streams`` (a server sizes it once, before opening streams: an engine with
        open streams is not resized)."""
        with self.lock:
            engine = self._stream_engines.get(lookahead)
            if engine is not None and max_streams is not None and max_streams != engine.max_streams:
                if engine.open_streams:
                    raise ValueError(f"the shared stream engine has {engine.open_streams} open streams: it cannot be "
                                     f"resized from {engine.max_streams} to {max_streams} slots now")
                engine = None
            if engine is None:
                engine = self._stream_engines[lookahead] = self.stream_engine(max_streams or 256, lookahead=lookahead)
            return engine

    def _validate_structure(self, codes: list[Tensor]) -> None:
        validate_codes(codes, self.config, check_ids=False)

    def check_fidelity(self, codes: list[Tensor], *, seed: int = 0, baseline: bool = True,
                       reference_device: torch.device | str | None = None):
        """SNR, max error and log-mel distance of this model's decode against the original upstream
        model (float32, same weights, same noise); see :func:`snac_fast.fidelity.compare`."""
        from snac_fast.fidelity import compare

        return compare(self, None, codes, seed=seed, baseline=baseline, reference_device=reference_device)

    def profile(self, codes: list[Tensor], **options):
        """Per-layer decode timing of this model and of the original; see :func:`snac_fast.profiling.profile`."""
        from snac_fast.profiling import profile

        return profile(self, codes, **options)

    def encode(self, audio: Tensor, *, lengths: Sequence[int] | Tensor | None = None,
               chunk_seconds: float | None = 60.0, cuda_graphs: bool | None = None,
               check_finite: bool = True, graphs: GraphedEncode | None = None) -> list[Tensor]:
        """Audio [B, 1, T] (floating, at :attr:`sampling_rate`, any device) -> codes, one int64
        [B, L_i] per level, as upstream's ``encode`` (audio right-padded with zeros to a multiple of
        :func:`snac_fast.encoding.padding_unit`). Audio longer than ``chunk_seconds`` (plus two
        halos of the encoder's receptive field, 0.26 s at 24 kHz) is encoded a chunk at a time, so
        memory stays bounded; every code is computed from the same samples as in a whole encode
        (identical codes in float32, see :mod:`snac_fast.encoding`). None: always whole.
        cuda_graphs: replay a CUDA graph per input shape (a codec built with CUDA graphs only); None:
        for inputs up to ``encode_graph_samples`` samples (B x chunk). Pass False for a stream of
        ever-new shapes (each capture costs about three encodes). check_finite=False skips the scan for
        NaN and infinite samples (for audio on the GPU, a wait for everything queued before it), for
        audio the caller has checked already.
        lengths: each row's own length in samples, for a batch of clips of different lengths
        zero-padded to one: each row is then encoded exactly as the clip alone (its samples past its
        length ignored; codes past ``code_lengths`` of it are padding), see
        :func:`snac_fast.encoding.rows_as_alone`. None: every row is T samples long.
        graphs: replay from this cache instead of the codec's own where ``cuda_graphs`` allows (the
        corpus engine's: each shape captured on its second call, one memory pool for all)."""
        audio = validate_audio(audio, check_finite)
        row_lengths = None if lengths is None else validate_lengths(lengths, audio)
        if chunk_seconds is not None and not chunk_seconds > 0:
            raise ValueError(f"chunk_seconds must be positive or None, got {chunk_seconds}")
        unit = padding_unit(self.config)
        chunk = None if chunk_seconds is None else math.ceil(chunk_seconds * self.sampling_rate)
        with self.lock, device_scope(self.device), torch.inference_mode():
            audio = audio.to(device=self.device, dtype=self.dtype)
            audio = F.pad(audio, (0, -audio.shape[-1] % unit))
            padded_lengths = None
            if row_lengths is not None:
                # each row as upstream pads it alone: zeros from its own length to a multiple of the unit
                ends = _on_device(torch.tensor(row_lengths), self.device)
                audio = audio * (torch.arange(audio.shape[-1], device=self.device) < ends[:, None])[:, None, :]
                # rows that fill the batch (padded to the unit) need no clearing
                if min(n + -n % unit for n in row_lengths) < audio.shape[-1]:
                    padded_lengths = ends + -ends % unit
            if cuda_graphs is None:
                cuda_graphs = audio.shape[0] * min(audio.shape[-1], chunk or audio.shape[-1]) <= self.encode_graph_samples
            graphs = (self.encode_graphs if graphs is None else graphs) if cuda_graphs else None
            return encode_padded(self.model, audio, unit, chunk, self.encoder_reach, graphs, padded_lengths)


# the options of FastSNAC.from_pretrained that say where a checkpoint is (a Checkpoint found already has them)
HUB_OPTIONS = ("revision", "cache_dir", "local_files_only", "token")


def load_codec(model: str | os.PathLike | Checkpoint | None = None, *, device: torch.device | str | None = None,
               dtype: torch.dtype | str | None = None, **options) -> FastSNAC:
    """The one way the CLI, the server, the engine process and the corpus runs load a codec:
    :meth:`FastSNAC.from_pretrained` of ``model`` (default :data:`~snac_fast.configs.DEFAULT_MODEL`;
    a :class:`~snac_fast.model.loading.Checkpoint` already found is loaded as it is, the hub options of
    ``options`` left out)."""
    if isinstance(model, Checkpoint):
        options = {k: v for k, v in options.items() if k not in HUB_OPTIONS}
    return FastSNAC.from_pretrained(model or DEFAULT_MODEL, device=device, dtype=dtype, **options)


def _on_device(host: Tensor, device: torch.device) -> Tensor:
    """A small host tensor on ``device``, pinned and not waited for on a GPU (threads that launch
    encodes queue them ahead of the device)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _config_of(model: nn.Module) -> dict:
    """A config dict from an upstream SNAC's attributes (for models built without a config file)."""
    return {
        "sampling_rate": model.sampling_rate, "encoder_dim": model.encoder_dim,
        "encoder_rates": list(model.encoder_rates), "latent_dim": model.latent_dim,
        "decoder_dim": model.decoder_dim, "decoder_rates": list(model.decoder_rates),
        "attn_window_size": model.attn_window_size,
        "codebook_size": model.codebook_size, "codebook_dim": model.codebook_dim,
        "vq_strides": list(model.vq_strides),
        "noise": any(type(m).__name__ == "NoiseBlock" for m in model.decoder.modules()),
        "depthwise": model.decoder.model[0].groups > 1,
    }


def _own_inference_tensors(model: nn.Module) -> None:
    """Replace parameters and buffers made under ``torch.inference_mode`` by normal copies: inference
    tensors carry no version counter (the fused modules key their weight caches on it) and cannot be
    used outside inference mode."""
    with torch.no_grad():
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if p.is_inference():
                    setattr(module, name, nn.Parameter(p.clone(), requires_grad=p.requires_grad))
            for name, b in list(module.named_buffers(recurse=False)):
                if b.is_inference():
                    module._buffers[name] = b.clone()
