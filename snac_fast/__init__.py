"""snac-fast: the SNAC neural audio codec with Triton kernels on its decode path."""

from snac_fast.api import FastSNAC
from snac_fast.codes import load_tokens, save_tokens
from snac_fast.model.loading import CheckpointError
from snac_fast.model.modules import FastSnake1d
from snac_fast.model.surgery import SurgeryReport, accelerate
from snac_fast.ops.snake import snake, snake_reference

# what README's streaming and serving examples use, imported on first access (a decode-only
# process does not pay for the batchers' imports)
_LAZY = {
    "ORPHEUS": "snac_fast.orpheus", "TokenLayout": "snac_fast.orpheus",
    "DecoderStream": "snac_fast.streaming", "StreamEngine": "snac_fast.streaming",
    "AsyncStreamBatcher": "snac_fast.serve", "StreamBatcher": "snac_fast.serve",
}

__all__ = [
    "CheckpointError", "FastSNAC", "FastSnake1d", "SurgeryReport", "accelerate",
    "load_tokens", "save_tokens", "snake", "snake_reference", *_LAZY,
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'snac_fast' has no attribute {name!r}")
