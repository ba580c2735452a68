"""Module surgery on an upstream ``snac.SNAC``: Snake1d -> FastSnake1d, weight norm folded, layers fused.

Everything else in the module tree stays as it is, so code that knows upstream's layout keeps working.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from snac_fast.model.local_attention import HalfLocalMHA, upstream_attention
from snac_fast.model.modules import (
    Absorbed,
    DepthwiseConv1d,
    DepthwisePointwiseConv1d,
    FastSnake1d,
    FusedConvTranspose1d,
    FusedDenseConv1d,
    FusedNoiseBlock,
    FusedResidualUnit,
    FusedResidualVectorQuantize,
    OutputConvTanh,
    PackedWeights,
    SnakeOut,
    absorb,
    is_pointwise,
    is_same_padding_depthwise,
)


@dataclass
class SurgeryReport:
    """What :func:`accelerate` changed: qualified module names."""

    decoder_snakes: list[str] = field(default_factory=list)  # Snake1d -> FastSnake1d in the decoder
    encoder_snakes: list[str] = field(default_factory=list)
    folded_weight_norms: list[str] = field(default_factory=list)
    float32_attention: list[str] = field(default_factory=list)  # LocalMHA kept in float32 (half dtypes, fuse=False)
    half_attention: list[str] = field(default_factory=list)  # LocalMHA -> HalfLocalMHA (half dtypes, fused)
    fused: dict[str, list[str]] = field(default_factory=dict)  # kind -> layers replaced by fused kernels
    absorbed: list[str] = field(default_factory=list)  # layers now computed inside a neighbour's kernel

    @property
    def fused_residual_units(self) -> list[str]:
        return self.fused.get("residual_units", [])

    def counts(self) -> dict[str, int]:
        """How many modules each kind of change touched (the lists stay on the attributes)."""
        counts = {"decoder snakes": len(self.decoder_snakes), "encoder snakes": len(self.encoder_snakes),
                  "folded weight norms": len(self.folded_weight_norms)}
        counts.update({f"fused {kind.replace('_', ' ')}": len(names) for kind, names in self.fused.items()})
        counts["absorbed into a neighbour's kernel"] = len(self.absorbed)
        counts["float32 attention"] = len(self.float32_attention)
        counts["half-precision attention"] = len(self.half_attention)
        return {k: v for k, v in counts.items() if v}

    def __str__(self) -> str:
        return "SurgeryReport(" + ", ".join(f"{k}: {v}" for k, v in self.counts().items()) + ")"

    def __repr__(self) -> str:
        return str(self)


def expected_snake_counts(model: nn.Module) -> tuple[int, int]:
    """(decoder, encoder) Snake1d counts that upstream's architecture builds: each DecoderBlock has
    1 + 3 residual units x 2, plus the decoder's last layer; each EncoderBlock 3 x 2 + 1."""
    return 7 * len(model.decoder_rates) + 1, 7 * len(model.encoder_rates)


def _swap_snakes(root: nn.Module, prefix: str) -> list[str]:
    from snac.layers import Snake1d

    swapped = []
    for parent_name, parent in list(root.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, Snake1d):
                setattr(parent, child_name, FastSnake1d.from_snake(child))
                swapped.append(".".join(p for p in (prefix, parent_name, child_name) if p))
    return swapped


def fold_weight_norm(model: nn.Module) -> list[str]:
    """Replace every weight-norm parametrization by the plain weight it computes (same values, no
    per-forward recomputation: upstream rebuilds 38 decoder weights on every call)."""
    folded = []
    for name, module in model.named_modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
            folded.append(name)
    return folded


def _float32_input(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.float() if torch.is_tensor(a) else a for a in args)


def _back_to_activation_dtype(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out.to(module.activation_dtype)


def keep_attention_float32(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Run the 32/44 kHz models' LocalMHA in float32 inside a half-precision model.

    Upstream cannot run it in half at all: its rotary embedding multiplies q and k by a float32
    scale, so they become float32 while v stays half and scaled_dot_product_attention refuses the
    mix. This is how upstream baselines run in half (the fidelity check's plain upstream, the
    benchmarks' folded peer) and what ``accelerate(fuse=False)`` does; fused half models run
    :class:`~snac_fast.model.local_attention.HalfLocalMHA` instead (20-37% faster 32 kHz decodes and encodes,
    `attention_ab_h100.md` (3f9392a)).
    """
    from snac.attention import LocalMHA

    kept = []
    for name, module in model.named_modules():
        if isinstance(module, LocalMHA) and not hasattr(module, "activation_dtype"):
            module.float()
            module.activation_dtype = dtype
            module.register_forward_pre_hook(_float32_input)
            module.register_forward_hook(_back_to_activation_dtype)
            kept.append(name)
    return kept


def to_device_dtype(model: nn.Module, device: torch.device | str | None, dtype: torch.dtype | None) -> list[str]:
    """``model.to(device, dtype)``; for half dtypes upstream's attention stays float32 (see above)."""
    model.to(device=device, dtype=dtype)
    if dtype in (torch.float16, torch.bfloat16):
        return keep_attention_float32(model, dtype)
    return []


def _execution_order(seq: nn.Sequential, prefix: str, block_type: type) -> list[tuple[str, nn.Sequential, int]]:
    """(qualified name, parent Sequential, index) of ``seq``'s layers in the order they run, with
    each ``block_type`` (DecoderBlock, EncoderBlock) opened into its own layers."""
    order = []
    for i, layer in enumerate(seq):
        if isinstance(layer, block_type) and isinstance(getattr(layer, "block", None), nn.Sequential):
            order.extend((f"{prefix}.{i}.block.{j}", layer.block, j) for j in range(len(layer.block)))
        else:
            order.append((f"{prefix}.{i}", seq, i))
    return order


def fuse_decoder(model: nn.Module) -> dict[str, list[str]]:
    """Replace the decoding path's layers by fused kernels that keep the same submodules and parameters:
    codes -> latent (one kernel), the input depthwise + 1x1 convs (two), each residual unit (two),
    each NoiseBlock (one), each transposed conv (phase GEMM with bias, or cuDNN for large outputs
    with the bias moved into the NoiseBlock; the layer before it writes its input channels-last),
    the output conv + tanh (one). A decoder-level
    Snake1d runs in the epilogue of the fused layer before it when there is one, else in the
    transposed conv after it; a residual unit's first Snake1d is written by the NoiseBlock or unit
    before it, beside its output. Needs FastSnake1d and folded weights. Returns the replaced names by
    kind ("absorbed": layers now computed inside a neighbour).
    """
    from snac.layers import DecoderBlock
    from snac.vq import ResidualVectorQuantize

    done: dict[str, list[str]] = {"quantizer": [], "input_convs": [], "residual_units": [], "noise_blocks": [],
                                  "conv_transposes": [], "output_conv": [], "absorbed": []}
    if type(model.quantizer) is ResidualVectorQuantize:
        model.quantizer = FusedResidualVectorQuantize.from_quantizer(model.quantizer)
        done["quantizer"].append("quantizer")
    seq = model.decoder.model
    if len(seq) > 1 and is_same_padding_depthwise(seq[0]) and is_pointwise(seq[1]) and seq[1].in_channels == seq[0].out_channels:
        seq[0], seq[1] = DepthwisePointwiseConv1d.from_convs(seq[0], seq[1], "decoder.model.0")
        done["input_convs"].append("decoder.model.0")
        done["absorbed"].append("decoder.model.1")
    if len(seq) > 1 and type(seq[-1]) is nn.Tanh and type(seq[-2]) is nn.Conv1d:
        with contextlib.suppress(ValueError):  # an unusual output conv stays as it is
            seq[-2] = OutputConvTanh.from_conv(seq[-2])
            seq[-1] = absorb(seq[-1], f"decoder.model.{len(seq) - 2}")
            done["output_conv"].append(f"decoder.model.{len(seq) - 2}")
            done["absorbed"].append(f"decoder.model.{len(seq) - 1}")
    _fuse_layers(_execution_order(seq, "decoder.model", DecoderBlock), done)
    return done


def _fuse_layers(order: list[tuple[str, nn.Sequential, int]], done: dict[str, list[str]]) -> None:
    """Fuse the layers of one path (in execution order), recording names in ``done``: residual
    units, NoiseBlocks, transposed convs and dense convs replaced; each Snake1d moved into the epilogue of the
    fused layer before it, else into the transposed conv after it; a residual unit's first snake
    written by the layer before it, beside its output; a transposed conv's input laid out [B, T, C]."""
    from snac.layers import NoiseBlock, ResidualUnit

    for name, parent, i in order:
        layer = parent[i]
        if type(layer) is ResidualUnit and FusedResidualUnit.fusable(layer):
            parent[i] = FusedResidualUnit.from_unit(layer)
            done.setdefault("residual_units", []).append(name)
        elif type(layer) is NoiseBlock:
            parent[i] = FusedNoiseBlock.from_block(layer)
            done.setdefault("noise_blocks", []).append(name)
        elif FusedConvTranspose1d.fusable(layer):
            parent[i] = FusedConvTranspose1d.from_conv(layer)
            done.setdefault("conv_transposes", []).append(name)
        elif FusedDenseConv1d.fusable(layer):
            parent[i] = FusedDenseConv1d.from_conv(layer)
            done.setdefault("dense_convs", []).append(name)
    for (_, parent, i), (_, next_parent, j) in zip(order, order[1:]):
        if isinstance(parent[i], FusedConvTranspose1d) and isinstance(next_parent[j], FusedNoiseBlock):
            next_parent[j].follow(parent[i])
    previous: tuple[str, nn.Module] | None = None  # the last layer that computes something
    for k, (name, parent, i) in enumerate(order):
        layer = parent[i]
        if type(layer) is FastSnake1d:
            if previous is not None and isinstance(previous[1], SnakeOut) and previous[1].alpha_out is None:
                parent[i] = absorb(layer, previous[0])  # the tree's module: .to() and loading reach it
                previous[1].absorb_next_snake(parent[i])
                done["absorbed"].append(name)
                continue
            next_name, next_parent, j = order[k + 1] if k + 1 < len(order) else (None, None, None)
            if next_parent is not None and isinstance(next_parent[j], FusedConvTranspose1d):
                parent[i] = absorb(layer, next_name)
                next_parent[j].absorb_previous_snake(parent[i])
                done["absorbed"].append(name)
                continue
        if not isinstance(layer, Absorbed):
            previous = (name, layer)
    # a residual unit's first snake: written by the layer before it, beside that layer's output
    for (name, parent, i), (next_name, next_parent, j) in zip(order, order[1:]):
        layer, unit = parent[i], next_parent[j]
        if (isinstance(layer, (FusedNoiseBlock, FusedResidualUnit, FusedDenseConv1d)) and isinstance(unit, FusedResidualUnit)
                and layer.alpha_out is None and type(unit.block[0]) is FastSnake1d):
            unit.block[0] = absorb(unit.block[0], name)
            layer.pair_next_snake(unit.block[0])
            done["absorbed"].append(f"{next_name}.block.0")
    # transposed and dense convs read [B, T, C] memory fastest (aligned shifted loads; cuDNN without
    # layout transforms), and the attention's LayerNorm reads it without a transposing copy: the
    # layer before writes that layout
    computing = [parent[i] for _, parent, i in order if not isinstance(parent[i], Absorbed)]
    reads_channels_last = (FusedConvTranspose1d, FusedDenseConv1d, upstream_attention())
    for layer, after in zip(computing, computing[1:]):
        if (isinstance(after, reads_channels_last) and isinstance(layer, (FusedResidualUnit, DepthwisePointwiseConv1d))
                and layer.snake_pair is None):
            layer.write_channels_last()


def _attention_applies_next_snake(seq: nn.Sequential, prefix: str) -> None:
    """A HalfLocalMHA followed by a DecoderBlock whose transposed conv runs the block's input snake
    takes that snake into its output projection's epilogue and writes the conv's input [B, T, C]
    (the conv twice as fast at 32/44 kHz chunks, and one snake launch less; docs/measurements.md)."""
    from snac.layers import DecoderBlock

    for i, (layer, after) in enumerate(zip(seq, seq[1:])):
        if type(layer) is HalfLocalMHA and isinstance(after, DecoderBlock) and layer.alpha_out is None:
            conv = next((m for m in after.block if isinstance(m, FusedConvTranspose1d)), None)
            if conv is not None and conv.snake_in is not None:
                layer.take_snake_of(conv, f"{prefix}.{i}")


def fuse_encoder(model: nn.Module) -> dict[str, list[str]]:
    """The encoding path on fused kernels: the input conv and each strided conv as an implicit GEMM
    that also writes the next residual unit's input snake; each residual unit in two kernels, the
    last of a block applying the snake before the strided conv and writing its input channels-last;
    the output depthwise conv7 on the depthwise kernel; the quantizer's encoding in float32
    (:func:`snac_fast.ops.codebook.quantize`). The 32/44 kHz attention stays upstream's. Needs FastSnake1d, folded weights and a FusedResidualVectorQuantize (fuse_decoder
    makes it). Returns the replaced names by kind ("absorbed": layers now computed inside a neighbour)."""
    from snac.layers import EncoderBlock

    done: dict[str, list[str]] = {"dense_convs": [], "residual_units": [], "output_conv": [], "quantizer": [],
                                  "absorbed": []}
    seq = model.encoder.block
    _fuse_layers(_execution_order(seq, "encoder.block", EncoderBlock), done)
    if is_same_padding_depthwise(seq[-1]):
        seq[-1] = DepthwiseConv1d.from_conv(seq[-1])
        done["output_conv"].append(f"encoder.block.{len(seq) - 1}")
    if isinstance(model.quantizer, FusedResidualVectorQuantize):
        model.quantizer.fused_encode = True
        done["quantizer"].append("quantizer")
    return done


def accelerate(
    model: nn.Module,
    *,
    encoder: bool = True,
    fold_weights: bool = True,
    fuse: bool = True,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> SurgeryReport:
    """Apply snac-fast's surgery to an upstream ``snac.SNAC`` in place.

    Swaps the decoder's Snake1d (29 in the published models) for :class:`FastSnake1d` sharing the
    same alpha, the encoder's too unless ``encoder=False``, folds weight norm unless
    ``fold_weights=False``, fuses the decoder (:func:`fuse_decoder`) and, with ``encoder``, the
    encoder (:func:`fuse_encoder`) unless ``fuse=False`` (needs folded weights), then moves the model
    to ``device``/``dtype`` when given. In float16 and bfloat16 the 32/44 kHz attention becomes
    :class:`~snac_fast.model.local_attention.HalfLocalMHA` (fused models) or stays float32 (``fuse=False``, see
    :func:`keep_attention_float32`).
    Raises ValueError when the model is not a SNAC or its Snake1d count is not the architecture's.
    """
    import snac

    if not isinstance(model, snac.SNAC):
        raise ValueError(f"accelerate expects a snac.SNAC, got {type(model).__name__}")
    if fuse and not fold_weights:  # before any change to the model
        raise ValueError("fuse=True needs fold_weights=True: the fused kernels read plain weights")
    want_dec, want_enc = expected_snake_counts(model)
    report = SurgeryReport()
    report.decoder_snakes = _swap_snakes(model.decoder, "decoder")
    if encoder:
        report.encoder_snakes = _swap_snakes(model.encoder, "encoder")
    for part, want in (("decoder", want_dec), ("encoder", want_enc if encoder else None)):
        if want is None:
            continue
        have = sum(isinstance(m, FastSnake1d) for m in getattr(model, part).modules())
        if have != want:
            raise ValueError(f"{part} has {have} FastSnake1d after surgery, the architecture has {want} Snake1d")
    if fold_weights:
        report.folded_weight_norms = fold_weight_norm(model)
    if fuse:
        report.fused = fuse_decoder(model)
        report.absorbed = report.fused.pop("absorbed")
        if encoder:
            encoder_fused = fuse_encoder(model)
            report.absorbed += encoder_fused.pop("absorbed")
            report.fused.update({f"encoder_{kind}": names for kind, names in encoder_fused.items()})
    if fuse and dtype in (torch.float16, torch.bfloat16):
        model.to(device=device, dtype=dtype)
        report.half_attention = [name for name, m in model.named_modules() if type(m) is upstream_attention()]
        for name in report.half_attention:
            HalfLocalMHA.convert(model.get_submodule(name))
        if fuse:
            _attention_applies_next_snake(model.decoder.model, "decoder.model")
    elif device is not None or dtype is not None:
        report.float32_attention = to_device_dtype(model, device, dtype)
    for module in model.modules():  # on the final device and dtype, outside torch.compile
        if isinstance(module, (PackedWeights, FusedNoiseBlock)):
            module.pack()
    return report
