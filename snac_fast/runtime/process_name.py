"""The name a process shows in ``ps``, ``top`` and ``/proc/<pid>/comm``: a server's engine process and
its workers are spawned by multiprocessing, so their command lines look alike and alike their
parent's; a name each tells them apart, for an operator and for the load benchmark's CPU split."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

ENGINE_NAME = "snac-engine"  # serve's engine process
WORKER_NAME = "snac-worker"  # each of serve's worker processes (--workers N > 1)
PR_SET_NAME = 15  # linux/prctl.h
MAX_NAME_BYTES = 15  # the kernel's TASK_COMM_LEN less its NUL


def name_process(name: str) -> bool:
    """Name this process (``name``, ASCII, at most 15 bytes: called from its main thread, whose name
    is the process's). False where that cannot be done (not Linux, no libc)."""
    encoded = name.encode("ascii")
    if len(encoded) > MAX_NAME_BYTES:
        raise ValueError(f"a process name holds at most {MAX_NAME_BYTES} bytes: {name!r}")
    if not sys.platform.startswith("linux") or (library := ctypes.util.find_library("c")) is None:
        return False
    try:
        return ctypes.CDLL(library, use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(encoded), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
