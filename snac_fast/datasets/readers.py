"""Reader processes: audio read, mixed and resampled off the GPU's process, shards ahead."""

from __future__ import annotations

import importlib
import math
import mmap
import multiprocessing
import os
import shutil
import sys
import tempfile
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import repeat
from pathlib import Path

import numpy as np
import torch

from snac_fast.datasets.inputs import AudioInput, Clip, read_clip

# shards being read ahead of the one being batched: with one, the readers sat idle while the
# previous shard was collected and batched (docs/measurements.md)
READ_AHEAD = 2

# reads in flight per reader process (threads: soundfile, numpy and torch's convs release the GIL).
# Fewer processes to fork: a fork from a process with a CUDA context took 10-21 ms, and the pool
# hands out no task until all are forked; the threads of a process also share its conv kernels'
# one-time set-up per input length (docs/datasets.md)
THREADS_PER_READER = 2

# the reader process's threads (made in it by _start_reader, after the fork: a fork copies no thread)
_threads: ThreadPoolExecutor | None = None


def _read_clips(items: list[AudioInput], rate: int, dtype: str, spool: str) -> tuple[str | None, list[tuple]]:
    """A reader process's task: the items' audio (as ``dtype``) written one after another into a
    new file in ``spool``, and (samples, duration, sampling rate, error) per item. If the spool
    cannot take the file, the arrays come back themselves (path None)."""
    if _threads is not None and len(items) > 1:
        clips = list(_threads.map(read_clip, items, repeat(rate)))
    else:
        clips = [read_clip(item, rate) for item in items]
    arrays = [None if c.audio is None else c.audio.astype(dtype, copy=False) for c in clips]
    meta = [(None if a is None else a.size, c.duration, c.sampling_rate, c.error) for a, c in zip(arrays, clips)]
    try:
        fd, path = tempfile.mkstemp(dir=spool)
        with os.fdopen(fd, "wb") as f:
            for a in arrays:
                if a is not None:
                    f.write(memoryview(a))
        return path, meta
    except OSError:
        return None, [(a, *m[1:]) for a, m in zip(arrays, meta)]


def _map_read_only(fd: int, size: int) -> mmap.mmap:
    if not hasattr(mmap, "MAP_SHARED"):  # Windows
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    # populated in the call: no page fault per 4 KB later, in the thread that launches kernels
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)


def _start_reader(threads: int = 1) -> None:
    global _threads
    torch.set_num_threads(1)  # one read per core; and no OpenMP pool inherited across fork
    try:
        # the lowest priority: beside busy readers the launching thread waited for a CPU twice as
        # long at the default priority (docs/measurements.md)
        os.nice(19)
    except (AttributeError, OSError):  # no os.nice (Windows), or not permitted
        pass
    # after the nice: threads inherit their creator's priority (they start at the first task)
    _threads = ThreadPoolExecutor(threads, "snac-fast-read") if threads > 1 else None


class Readers:
    """Worker processes reading audio (see the module docstring), a shard's files in small tasks,
    ``readers`` reads at a time: ``THREADS_PER_READER`` threads in each process.

    A task's audio comes back through a file in a spool folder on /dev/shm (memory), which this
    process maps: through the pool's pipe, its result thread spent about as long unpickling 2 GB
    of audio as the encode took, holding the GIL the launching thread needs. Audio is sent in the
    dtype batches are built in (float16 for a float16 codec: half the bytes)."""

    def __init__(self, readers: int, rate: int, dtype: torch.dtype = torch.float32) -> None:
        """readers: files read at a time, in ceil(readers / THREADS_PER_READER) processes of equal
        threads (an odd count rounds up by one); dtype: the audio's on the way back (:func:`batch_dtype`)."""
        self.processes = math.ceil(readers / THREADS_PER_READER)
        self.threads = math.ceil(readers / self.processes)
        self.rate = rate
        self.dtype = torch.empty(0, dtype=dtype).numpy().dtype.name
        # fork: no re-import of torch per worker; the children never touch CUDA
        self.context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        for module in ("soundfile", "torchaudio.transforms"):  # imported once here, not in every forked reader
            importlib.import_module(module)
        shm = Path("/dev/shm")
        self.spool = tempfile.mkdtemp(prefix="snac-fast-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None)
        self.pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.processes, mp_context=self.context, initializer=_start_reader,
                                   initargs=(self.threads,))

    def __enter__(self) -> "Readers":
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.spool, ignore_errors=True)

    def _submit(self, items: list[AudioInput]) -> Future:
        return self.pool.submit(_read_clips, items, self.rate, self.dtype, self.spool)

    def submit(self, items: list[AudioInput]) -> list[Future]:
        # two tasks per process and shard (every task costs this process's threads some GIL time),
        # at most 8 files per reading thread a task
        size = max(1, min(8 * self.threads, len(items) // (2 * self.processes)))
        try:
            return [self._submit(items[k:k + size]) for k in range(0, len(items), size)]
        except BrokenProcessPool:
            return []  # collect reads them one by one

    def collect(self, items: list[AudioInput], futures: list[Future]) -> list[Clip]:
        """The clips of ``items`` (read by the tasks ``submit`` returned for them)."""
        try:
            if futures:
                results = [self._unpack(*f.result()) for f in futures]
                return [Clip(item, *r) for item, r in zip(items, (r for rs in results for r in rs))]
        except BrokenProcessPool:
            pass
        self._restart()  # a reader died: this shard again, one file per task, to pin the crash on its file
        return [self._read_alone(item) for item in items]

    def _unpack(self, path: str | None, meta: list[tuple]) -> list[tuple]:
        """A task's (audio, duration, sampling rate, error) per item: views of its spool file,
        mapped read-only (the views keep the mapping; the file is unlinked at once)."""
        if path is None:
            return meta
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = _map_read_only(f.fileno(), size) if size else b""
        os.unlink(path)
        out, offset = [], 0
        for samples, *rest in meta:
            audio = None if samples is None else np.frombuffer(data, self.dtype, samples, offset)
            offset += 0 if samples is None else audio.nbytes
            out.append((audio, *rest))
        return out

    def _read_alone(self, item: AudioInput) -> Clip:
        try:
            return Clip(item, *self._unpack(*self._submit([item]).result())[0])
        except BrokenProcessPool:
            self._restart()
            return Clip(item, None, None, None, "the reader process died reading this file (a crash in the audio library)")

    def release(self) -> None:
        """No more reads: the processes exit now, not when the run ends (joining them took 35-65 ms)."""
        self.pool.shutdown(wait=False)

    def _restart(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.pool = self._new_pool()
