"""Freed host memory handed back to the OS (snac_fast.runtime.host_memory): glibc keeps freed heap
pages below a live block; ``malloc_trim`` returns them, which is what keeps a server's RSS flat."""

import subprocess
import sys
import threading
import time

import pytest

from snac_fast.runtime import host_memory

# In a fresh interpreter: 400 blocks of 100 KB from the heap (below glibc's 128 KB mmap threshold),
# each written so its pages are resident; all but the last freed, so the live last block pins the
# heap's top and free() alone can hand nothing back. RSS (MB) after the frees, then after a trim.
PROBE = """
import ctypes, ctypes.util, sys
from snac_fast.runtime.host_memory import malloc_trim, status_bytes
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return status_bytes("VmRSS") / (1 << 20)
blocks = [libc.malloc(100 << 10) for _ in range(400)]
for b in blocks:
    ctypes.memset(b, 1, 100 << 10)
for b in blocks[:-1]:
    libc.free(b)
freed = rss()
malloc_trim()()
print(freed, rss())
"""


@pytest.mark.skipif(host_memory.malloc_trim() is None, reason="no glibc malloc_trim on this system")
def test_a_trim_hands_back_heap_pages_a_live_block_pins():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    freed, trimmed = map(float, out.split())
    assert freed - trimmed > 30, (freed, trimmed)  # ~39 MB of freed blocks held until the trim


def test_trims_run_on_a_thread_every_interval_and_never_at_zero(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "malloc_trim", lambda: lambda: calls.append(time.monotonic()) or True)
    monkeypatch.setattr(host_memory, "_trimmer", None)  # not the process's own, if a server started one
    assert host_memory.trim_periodically(0) is None
    thread = host_memory.trim_periodically(0.05, due=lambda: True)
    assert thread is not None and thread.daemon and thread.name == "snac-fast-memory-trim"
    deadline = time.monotonic() + 10
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(calls) >= 3
    assert thread in threading.enumerate()
    assert host_memory.trim_periodically(0.05) is thread  # one per process: a second server gets the same


def test_a_trim_is_due_only_well_above_the_working_level():
    """The level: the first reading, the reading after each trim (its churn faulted back in), or
    any lower one. Churn under the slack is left alone (a trim would only fault it in again), a
    climb past it is handed back, however slowly it came."""
    MB = 1 << 20
    readings = iter([700, 720, 740, 690, 695, 760, 700, 650, 700, 660, 670, 680, 690])
    due = host_memory.TrimWhenAbove(slack_bytes=32 * MB, read=lambda: next(readings) * MB)
    assert [due() for _ in range(13)] == [False, False, True, False, False, True, False, False, True,
                                          False, False, False, False]
    assert due.level == 660 * MB
    assert host_memory.TrimWhenAbove(read=lambda: None)()  # cannot tell: trim, as before


# In a fresh interpreter (no other test's threads freeing memory meanwhile): RssAnon before and
# with a 64 MB block written page by page.
ANON_PROBE = """
from snac_fast.runtime.host_memory import anonymous_bytes
before = anonymous_bytes()
block = bytearray(64 << 20)
block[::4096] = b"\\x01" * len(block[::4096])
print(before, anonymous_bytes())
"""


@pytest.mark.skipif(host_memory.anonymous_bytes() is None, reason="no /proc/self/status RssAnon")
def test_anonymous_memory_counts_the_heap():
    out = subprocess.run([sys.executable, "-c", ANON_PROBE], capture_output=True, text=True, check=True).stdout
    before, during = map(int, out.split())
    assert during - before > 48 << 20, (before, during)
