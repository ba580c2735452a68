"""Freed host memory handed back to the OS while a server runs.

glibc's malloc keeps what a process frees for its own reuse: in its arenas, and, once a large block
has been freed, below an mmap threshold it raises to that block's size, so later blocks of that size
come from the heap, where a live block above them pins the pages. A serving process's RSS then climbs
to the high-water mark of its busiest moments and stays there, which reads as a leak to the people
watching it (a CPU server: a prefill's activations peak at ~42 MB a stream at 24 kHz, a frame's
step at ~12 MB, and RSS rose to the most of them that ever met; docs/http_server.md, the soak).
``malloc_trim(0)`` returns every free page of every arena (madvise, not only the heap's top), so a
trim now and then keeps RSS at what is live. Not glibc (musl, macOS): nothing to call, nothing done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
import time
from typing import Callable


_trimmer: threading.Thread | None = None  # this process's, once started


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


def trim_periodically(every_s: float) -> threading.Thread | None:
    """A daemon thread calling :func:`malloc_trim` every ``every_s`` seconds (a trim walks the
    arenas: a few ms that no event loop waits for), for as long as the process lives: one per
    process (a trim covers every thread's arena), so a second call returns the first's thread; None
    where there is nothing to call or ``every_s`` is 0."""
    global _trimmer
    trim = malloc_trim()
    if trim is None or every_s <= 0:
        return None
    if _trimmer is not None and _trimmer.is_alive():
        return _trimmer

    def loop() -> None:
        while True:
            time.sleep(every_s)
            trim()

    _trimmer = threading.Thread(target=loop, name="snac-fast-memory-trim", daemon=True)
    _trimmer.start()
    return _trimmer
