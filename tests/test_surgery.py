"""Surgery: which Snakes each layer absorbs."""

from snac_fast import FastSNAC
from snac_fast.model.modules import AbsorbedSnake1d, FastSnake1d, FusedConvTranspose1d


def test_surgery_absorbs_snakes_by_architecture():
    """24 kHz: every decoder snake runs inside a neighbour. 32 kHz: the first block's snake follows
    attention, so its transposed conv applies it."""
    for name, into_conv in [("snac_24khz", []), ("snac_32khz", ["decoder.model.3.block.0"])]:
        fast = FastSNAC.from_pretrained(f"synthetic:{name}", device="cpu")
        modules = dict(fast.model.named_modules())
        snakes = [n for n in fast.report.absorbed if isinstance(modules[n], AbsorbedSnake1d) and n.startswith("decoder.")]
        assert sum(isinstance(m, FastSnake1d) for m in fast.model.decoder.modules()) == 29
        assert len(snakes) == 17  # 4 block inputs, the output snake, the first snake of 12 residual units
        # encoder: the snake before each of the 4 strided convs, the first snake of 12 residual units
        assert sum(n.startswith("encoder.") for n in fast.report.absorbed) == 16
        assert [n for n in snakes if isinstance(modules[modules[n].absorbed_by], FusedConvTranspose1d)] == into_conv
        assert type(fast.model.decoder.model[-1]).__name__ == "AbsorbedTanh"
        assert type(fast.model.quantizer).__name__ == "FusedResidualVectorQuantize"
