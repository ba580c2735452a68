"""Freed host memory handed back to the OS while a server runs.

glibc's malloc keeps what a process frees for its own reuse: in its arenas, and, once a large block
has been freed, below an mmap threshold it raises to that block's size, so later blocks of that size
come from the heap, where a live block above them pins the pages. A serving process's RSS then climbs
to the high-water mark of its busiest moments and stays there, which reads as a leak to the people
watching it (a CPU server before its calls' memory was bounded: RSS rose to the most prefills that
ever met; docs/http_server.md, the soak). ``malloc_trim(0)`` returns every free page of every arena
(madvise, not only the heap's top), so a trim when the heap lies well above its working level hands
a burst back. Not glibc (musl, macOS): nothing to call, nothing done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
import time
from typing import Callable


_trimmer: threading.Thread | None = None  # this process's, once started
# how far above its working level a process's heap may lie untrimmed (TrimWhenAbove)
TRIM_SLACK_BYTES = 32 << 20


@functools.cache
def malloc_trim() -> Callable[[], bool] | None:
    """glibc's ``malloc_trim(0)`` (True when it returned memory to the OS), or None without glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: bool(trim(0))


def status_bytes(field: str, pid: int | str = "self") -> int | None:
    """A memory figure of a process's ``/proc/<pid>/status`` (``VmRSS``, ``RssAnon``, ...) in bytes,
    or None where /proc cannot say (no such process, field or /proc)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def anonymous_bytes() -> int | None:
    """This process's resident anonymous memory (``RssAnon``: its heap, not its mapped files), or
    None where /proc cannot say."""
    return status_bytes("RssAnon")


class TrimWhenAbove:
    """Whether a trim is due, from one reading of ``RssAnon`` a check: when it lies more than
    ``slack_bytes`` above the process's working level, or cannot be read. The level is the reading
    at the check after a trim (the churn the process's next calls faulted back in), lowered to any
    reading below it. A working process reuses what it frees, so a trim every check only makes its
    calls fault the same pages in again (a CPU server's chunk gaps: max 309 ms untrimmed, 1.7 s
    trimmed every 5 s), while what it keeps after its rarer bursts climbs in small steps that only
    a fixed level catches (a level of the last minute's lowest let RSS climb 6% in 15 minutes)."""

    def __init__(self, slack_bytes: int = TRIM_SLACK_BYTES, read: Callable[[], int | None] = anonymous_bytes) -> None:
        self.slack, self.read = slack_bytes, read
        self.level: int | None = None
        self.trimmed = False

    def __call__(self) -> bool:
        now = self.read()
        if now is None:
            return True
        self.level = now if self.trimmed or self.level is None else min(self.level, now)
        self.trimmed = now > self.level + self.slack
        return self.trimmed


def trim_periodically(every_s: float, due: Callable[[], bool] | None = None) -> threading.Thread | None:
    """A daemon thread that every ``every_s`` seconds calls :func:`malloc_trim` where ``due`` says
    so (default :class:`TrimWhenAbove`), for as long as the process lives (a trim walks the arenas: a
    few ms that no event loop waits for): one per process (a trim covers every thread's arena), so a
    second call returns the first's thread; None where there is nothing to call or ``every_s`` is 0."""
    global _trimmer
    trim = malloc_trim()
    if trim is None or every_s <= 0:
        return None
    if _trimmer is not None and _trimmer.is_alive():
        return _trimmer
    due = due or TrimWhenAbove()

    def loop() -> None:
        while True:
            time.sleep(every_s)
            if due():
                trim()

    _trimmer = threading.Thread(target=loop, name="snac-fast-memory-trim", daemon=True)
    _trimmer.start()
    return _trimmer
