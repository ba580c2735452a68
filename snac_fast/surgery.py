"""Module surgery on an upstream ``snac.SNAC``: Snake1d -> FastSnake1d, weight norm folded.

Everything else in the module tree stays as it is, so code that knows upstream's layout keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from snac_fast.modules import BiasDeferredConvTranspose1d, FastSnake1d, FusedNoiseBlock, FusedResidualUnit


@dataclass
class SurgeryReport:
    """What :func:`accelerate` changed: qualified module names."""

    decoder_snakes: list[str] = field(default_factory=list)  # Snake1d -> FastSnake1d in the decoder
    encoder_snakes: list[str] = field(default_factory=list)
    folded_weight_norms: list[str] = field(default_factory=list)
    float32_attention: list[str] = field(default_factory=list)  # LocalMHA kept in float32 (half dtypes)
    fused_residual_units: list[str] = field(default_factory=list)  # ResidualUnit -> FusedResidualUnit
    fused_noise_blocks: list[str] = field(default_factory=list)  # NoiseBlock -> FusedNoiseBlock
    deferred_biases: list[str] = field(default_factory=list)  # ConvTranspose1d whose bias the next block adds


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
    mix. It runs once per decode at the lowest time resolution, so float32 costs little.
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
    """``model.to(device, dtype)``; for half dtypes the attention stays float32 (see above)."""
    model.to(device=device, dtype=dtype)
    if dtype in (torch.float16, torch.bfloat16):
        return keep_attention_float32(model, dtype)
    return []


def fuse_decoder(model: nn.Module) -> tuple[list[str], list[str], list[str]]:
    """Replace the decoder's ResidualUnits and NoiseBlocks by their fused versions (which keep the
    same submodules and parameters), and let each NoiseBlock add the bias of the ConvTranspose1d
    before it. Needs FastSnake1d and folded weights. Returns the replaced names."""
    from snac.layers import NoiseBlock, ResidualUnit

    units, noises, deferred = [], [], []
    for parent_name, parent in list(model.decoder.named_modules(prefix="decoder")):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}"
            if type(child) is ResidualUnit and FusedResidualUnit.fusable(child):
                setattr(parent, child_name, FusedResidualUnit.from_unit(child))
                units.append(name)
            elif type(child) is NoiseBlock:
                setattr(parent, child_name, FusedNoiseBlock.from_block(child))
                noises.append(name)
        if isinstance(parent, nn.Sequential):  # ConvTranspose1d then NoiseBlock: defer the bias
            for i in range(len(parent) - 1):
                conv, noise = parent[i], parent[i + 1]
                if (type(conv) is nn.ConvTranspose1d and conv.bias is not None and isinstance(noise, FusedNoiseBlock)
                        and conv.out_channels == noise.linear.in_channels):
                    parent[i] = BiasDeferredConvTranspose1d.from_conv(conv)
                    noise.take_bias_of(parent[i])
                    deferred.append(f"{parent_name}.{i}")
    return units, noises, deferred


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
    ``fold_weights=False``, fuses the decoder's residual units and NoiseBlocks into Triton kernels
    unless ``fuse=False`` (needs folded weights), then moves the model to ``device``/``dtype`` when given (in float16 and
    bfloat16 the 32/44 kHz attention stays float32, see :func:`keep_attention_float32`).
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
        report.fused_residual_units, report.fused_noise_blocks, report.deferred_biases = fuse_decoder(model)
    if device is not None or dtype is not None:
        report.float32_attention = to_device_dtype(model, device, dtype)
    return report
