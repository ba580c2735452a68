"""snac-fast: the SNAC neural audio codec with Triton kernels on its decode path."""

from snac_fast.api import FastSNAC
from snac_fast.codes import load_tokens, save_tokens
from snac_fast.loading import CheckpointError
from snac_fast.modules import FastSnake1d
from snac_fast.ops.snake import snake, snake_reference
from snac_fast.surgery import SurgeryReport, accelerate

__all__ = [
    "CheckpointError", "FastSNAC", "FastSnake1d", "SurgeryReport", "accelerate",
    "load_tokens", "save_tokens", "snake", "snake_reference",
]
__version__ = "0.1.0"
