"""Batching concurrent streams on one :class:`~snac_fast.streaming.StreamEngine`, for Python
servers of their own (``snac-fast serve`` uses it too): ``rounds`` (a round's engine calls) +
``drivers`` (an engine thread, or the event loop) -> ``batchers`` (:class:`AsyncStreamBatcher`,
:class:`StreamBatcher`); ``pcm`` (host audio of a call); ``futures`` (results to either kind of
future).
"""

from snac_fast.batching.batchers import AsyncStreamBatcher, StreamBatcher, freeze_startup_objects
from snac_fast.batching.pcm import PCMBlock, int16_pcm

__all__ = ["AsyncStreamBatcher", "PCMBlock", "StreamBatcher", "freeze_startup_objects", "int16_pcm"]
