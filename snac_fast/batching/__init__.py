"""Batching concurrent streams on one :class:`~snac_fast.streaming.StreamEngine`, for Python
servers of their own (``snac-fast serve`` uses it too): ``rounds`` (a round's engine calls) +
``streams`` (a batcher's streams) + ``intake`` (what waits for a round, and when it launches) +
``drivers`` (an engine thread, or the event loop) -> ``batchers`` (:class:`AsyncStreamBatcher`,
:class:`StreamBatcher`); ``pcm`` (host audio of a call); ``futures`` (results to either kind of
future); ``defaults`` (a library's and a server's call size and wait). Names are imported on first
access: ``defaults`` is read without importing torch.
"""

_NAMES = {"AsyncStreamBatcher": "batchers", "StreamBatcher": "batchers", "freeze_startup_objects": "batchers",
          "PCMBlock": "pcm", "int16_pcm": "pcm"}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        import importlib

        return getattr(importlib.import_module(f"snac_fast.batching.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'snac_fast.batching' has no attribute {name!r}")
