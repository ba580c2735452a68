"""torch.cuda's stream, event, graph and memory-pool entry points replaced by fakes that run on the
CPU and check their arguments the way torch checks them, so that a GPU-only path handing one of
them a wrong argument fails in CI rather than on a user's GPU.

The CPU device stands in for an *unindexed* CUDA device (``torch.device("cuda")``, what users
pass): an API that torch documents as wanting "a torch.device with a specified index or an
integer" (``use_mem_pool``, ``set_device``, ``set_per_process_memory_fraction``) refuses it as
torch refuses ``torch.device("cuda")``; those that fall back to the current device accept it.
``torch.cuda.current_device()`` is 0. Graph replays run nothing: the captures ran eagerly.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from torch.cuda._utils import _get_device_index

CURRENT_DEVICE = 0


def _as_cuda(device):
    """The CUDA device a CPU stand-in is taken for: cpu -> cuda (no index), cpu:N -> cuda:N."""
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device) and device.type == "cpu":
        return torch.device("cuda", device.index) if device.index is not None else torch.device("cuda")
    return device


def indexed(device) -> int:
    """torch's check for APIs that want an index: an int, or a CUDA device with its index."""
    return _get_device_index(_as_cuda(device), optional=False)


def optional_index(device) -> int:
    """torch's check for APIs that take the current device for an unindexed one (or None)."""
    if device is None:
        return CURRENT_DEVICE
    device = _as_cuda(device)
    if isinstance(device, torch.device) and device.index is None:
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        return CURRENT_DEVICE
    return _get_device_index(device, optional=False)


class FakeStream:
    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        self.device_index = optional_index(device)

    def wait_stream(self, stream) -> None:
        assert isinstance(stream, FakeStream), f"wait_stream got {stream!r}"

    def wait_event(self, event) -> None:
        assert isinstance(event, FakeEvent), f"wait_event got {event!r}"

    def record_event(self, event=None):
        return event or FakeEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class FakeEvent:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 external: bool = False) -> None:
        pass

    def record(self, stream=None) -> None:
        assert stream is None or isinstance(stream, FakeStream), f"Event.record got {stream!r}"

    def wait(self, stream=None) -> None:
        assert stream is None or isinstance(stream, FakeStream), f"Event.wait got {stream!r}"

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class FakeMemPool:
    _next = 1

    def __init__(self, *args, **kwargs) -> None:
        self.id = (0, FakeMemPool._next)
        FakeMemPool._next += 1


class FakeGraph:
    def __init__(self, *args, **kwargs) -> None:
        self.captured = False

    def replay(self) -> None:
        assert self.captured, "replay of a graph never captured"

    def reset(self) -> None:
        self.captured = False


class FakeDevice:
    """torch.cuda.device: a class (torch's own index check asks ``isinstance(d, torch.cuda.device)``)."""

    def __init__(self, device) -> None:
        self.idx = optional_index(device)

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


class FakeCuda:
    """The fakes' record: ``calls`` counts each entry point called; ``pools_entered`` lists the
    device index of each ``use_mem_pool``."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.pools_entered: list[int] = []
        self.captures = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> "FakeCuda":
        cuda = torch.cuda

        def counted(name, fn):
            def call(*args, **kwargs):
                self.calls[name] += 1
                return fn(*args, **kwargs)
            return call

        @contextlib.contextmanager
        def use_mem_pool(pool, device=None):
            assert isinstance(pool, FakeMemPool), f"use_mem_pool got {pool!r}"
            index = CURRENT_DEVICE if device is None else indexed(device)  # torch: _get_device_index(device)
            self.pools_entered.append(index)
            yield

        @contextlib.contextmanager
        def stream(s):
            assert s is None or isinstance(s, FakeStream), f"torch.cuda.stream got {s!r}"
            yield

        @contextlib.contextmanager
        def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            assert isinstance(cuda_graph, FakeGraph), f"torch.cuda.graph got {cuda_graph!r}"
            assert pool is None or (isinstance(pool, tuple) and len(pool) == 2), f"graph pool {pool!r}: a pool's id"
            assert stream is None or isinstance(stream, FakeStream), f"graph stream {stream!r}"
            yield
            cuda_graph.captured = True
            self.captures += 1

        def by_index(fn):
            return lambda device=None, *args, **kwargs: (optional_index(device), fn(*args, **kwargs))[1]

        fakes = {
            "Stream": FakeStream, "Event": FakeEvent, "MemPool": FakeMemPool, "CUDAGraph": FakeGraph,
            "device": FakeDevice, "use_mem_pool": use_mem_pool, "stream": stream, "graph": graph,
            "current_stream": lambda device=None: (optional_index(device), FakeStream())[1],
            "current_device": lambda: CURRENT_DEVICE,
            "set_device": lambda d: None if indexed(d) is None else None,
            "set_per_process_memory_fraction": lambda fraction, device=None: None if indexed(device) is None else None,
            "synchronize": by_index(lambda: None),
            "memory_allocated": by_index(lambda: 0),
            "max_memory_allocated": by_index(lambda: 0),
            "memory_reserved": by_index(lambda: 0),
            "reset_peak_memory_stats": by_index(lambda: None),
            "empty_cache": lambda: None,
            "graph_pool_handle": lambda: FakeMemPool().id,
        }
        for name, fake in fakes.items():
            monkeypatch.setattr(cuda, name, counted(name, fake) if callable(fake) and not isinstance(fake, type) else fake)
        # pinned host memory is plain memory here (a CPU-only torch cannot pin)
        zeros = torch.zeros
        monkeypatch.setattr(torch, "zeros", lambda *a, pin_memory=False, **k: zeros(*a, **k))
        return self
