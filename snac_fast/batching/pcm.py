"""Host PCM of engine calls: one call's audio end to end (:class:`PCMBlock`), the conversion on the
device (:func:`pcm_of`), and on CUDA the copies that bring it to the host (:class:`HostCopies`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor


class PCMBlock(Sequence):
    """One engine call's host PCM, end to end: ``pcm`` 1-D (int16 or float32), request j's audio
    ``pcm[offsets[j]:offsets[j + 1]]``. A sequence of those pieces (views); :meth:`span` takes
    consecutive ones at once without a Python step per piece."""

    def __init__(self, pcm: np.ndarray, offsets: np.ndarray) -> None:
        self.pcm, self.offsets = pcm, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, j: int) -> np.ndarray:
        if not 0 <= j < len(self):
            raise IndexError(j)
        return self.pcm[self.offsets[j]:self.offsets[j + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        bounds = self.offsets.tolist()
        return (self.pcm[a:b] for a, b in zip(bounds, bounds[1:]))

    def span(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Pieces ``start`` to ``stop - 1`` end to end, without a copy: (pcm 1-D, a view; offsets
        int64 [stop - start + 1] from 0)."""
        offsets = self.offsets[start:stop + 1]
        return self.pcm[offsets[0]:offsets[-1]], offsets - offsets[0]


def int16_pcm(audio: Tensor) -> Tensor:
    """Audio in [-1, 1] (any float dtype, any shape) as int16 PCM: scaled by 32767, rounded, clamped.
    Not in place: a float32 engine's audio is its own buffer."""
    return (audio.float() * 32767.0).round_().clamp_(-32768, 32767).to(torch.int16)


def pcm_of(audio: Tensor, output: str) -> Tensor:
    """An engine call's audio as ``output``'s samples, on its device: int16 PCM for ``"int16"``,
    else float32."""
    if output == "int16":
        return int16_pcm(audio)
    return audio if audio.dtype == torch.float32 else audio.float()


class HostCopies:
    """Engine calls' PCM from a CUDA device to the host: each copied into a pinned buffer, reused once
    its PCM is copied out (two calls are undelivered at most, more only while a refused push's call
    is retried push by push), its end a CUDA event a driver can poll while an event loop runs.

    ``size``: samples a buffer holds (one engine call's most); ``dtype``: the PCM's. The buffers are
    allocated now, not under load (cudaHostAlloc), and the conversion kernels' first launches (lazy
    module loads) run now, not in the first pushes. :attr:`gpu_seconds` adds up CUDA-event time from
    each call's start to its copy's end: an upper bound of the GPU's busy time (it includes the gaps
    while the host launches)."""

    def __init__(self, device: torch.device, output: str, size: int, engine_dtype: torch.dtype) -> None:
        self.device, self.output = device, output
        dtype = torch.int16 if output == "int16" else torch.float32
        self._free = [torch.empty(size, dtype=dtype, pin_memory=True) for _ in range(3)]
        self._stream: torch.cuda.Stream | None = None
        self.gpu_seconds = 0.0
        host, copied = self.start(pcm_of(torch.zeros(size, device=device, dtype=engine_dtype), output))
        copied.synchronize()
        self._free.append(host)
        self._stream = None  # the driver thread's own stream, looked up on its first call

    def begin(self) -> torch.cuda.Event:
        """An event at the start of an engine call, on the driver thread's stream."""
        begun = torch.cuda.Event(enable_timing=True)
        begun.record(self._driver_stream())
        return begun

    def start(self, pcm: Tensor) -> tuple[Tensor, torch.cuda.Event]:
        """Start copying ``pcm`` (1-D, on the device) into a free pinned buffer: (the buffer, the
        event its copy ends at)."""
        host = self._free.pop() if self._free else None
        if host is None or host.numel() < pcm.numel() or host.dtype != pcm.dtype:
            host = torch.empty(max(pcm.numel(), 2 * (0 if host is None else host.numel())), dtype=pcm.dtype,
                               pin_memory=True)
        host[:pcm.numel()].copy_(pcm, non_blocking=True)
        copied = torch.cuda.Event(enable_timing=True)
        copied.record(self._driver_stream())
        return host, copied

    def block(self, host: Tensor, copied: torch.cuda.Event, begun: torch.cuda.Event, offsets: np.ndarray) -> PCMBlock:
        """The call's PCM once its copy ended (waiting for it: the GIL released, an event loop runs
        meanwhile); the buffer is free again."""
        copied.synchronize()
        self.gpu_seconds += begun.elapsed_time(copied) / 1e3
        block = PCMBlock(host.numpy()[:offsets[-1]].copy(), offsets)
        self._free.append(host)
        return block

    def _driver_stream(self) -> torch.cuda.Stream:
        """The driver thread's CUDA stream, looked up once (each lookup queries the driver)."""
        if self._stream is None:
            self._stream = torch.cuda.current_stream(self.device)
        return self._stream
