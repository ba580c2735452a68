"""One stream engine process per GPU, fed by front-end processes (docs/batching.md, "Past one process").

One process serving thousands of streams is bound by its interpreter (the event loop and the
engine thread share one GIL), and one engine per worker process makes the GPU time-slice between
the processes' contexts. Here the engine has a process of its own: :class:`EngineProcess` starts
it (the model, the shared stream engine, an :class:`~snac_fast.serve.engine.batcher.EngineBatcher`),
and each front-end process (an HTTP worker, say) talks to it through an
:class:`~snac_fast.serve.engine.client.EngineClient` over a Unix socket
(``multiprocessing.connection``; messages: :mod:`snac_fast.serve.engine.wire`). In the engine
process one thread reads every front-end and queues each message's pushes as one block, the engine
thread runs the blocks as row slices of its engine calls and answers each call with one message per
front-end, and a thread per front-end sends those, so a front-end that reads slowly never holds up
the engine. With ``engine_calls="loop"`` one asyncio event loop does the reading, the engine calls
and the writing instead of those threads (docs/batching.md).

    engine = EngineProcess(EngineSettings(model="hubertsiuzdak/snac_24khz", max_streams=4096))  # parent
    client = EngineClient(engine.address)                                                      # front-end
    sid = await client.open(seed=1)
    pcm = await client.push_ids(sid, ids)     # int16 numpy audio that became final
    tail = await client.flush(sid)
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import pickle
import queue
import selectors
import socket
import sys
import tempfile
import threading
from multiprocessing.connection import Connection, Listener
from typing import Any

import numpy as np

from snac_fast.batching.batchers import freeze_startup_objects
from snac_fast.runtime.host_memory import trim_periodically
from snac_fast.runtime.process_name import ENGINE_NAME, name_process
from snac_fast.serve.engine.batcher import EngineBatcher, Front
from snac_fast.serve.engine.wire import LONG_SIZE, SIZE, audio_message
from snac_fast.serve.settings import EngineSettings, ServeSettings

ENGINE_OUTPUTS = ("int16", "float32")


class _ThreadFront(Front):
    """Messages go out through a thread of this front-end's own."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.streams = set()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._send_all, name="snac-fast-engine-sender", daemon=True).start()

    def send(self, message) -> None:
        self._outbox.put(message)

    def send_audio(self, reqs: np.ndarray, offsets: np.ndarray, pcm: np.ndarray) -> None:
        self._outbox.put((reqs, offsets, pcm))

    def stop(self) -> None:
        self._outbox.put(None)

    def _send_all(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                if type(message) is tuple:
                    self.conn.send_bytes(audio_message(*message))
                else:
                    self.conn.send(message)
            except (OSError, EOFError, BrokenPipeError):  # the front-end is gone: its reader releases its streams
                pass


class _LoopFront(Front):
    """Messages written to the event loop's transport of this front-end (buffered there: a write
    never waits), framed as ``multiprocessing.connection`` frames them."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.streams = set()

    def send(self, message) -> None:
        self._write(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))

    def send_audio(self, reqs: np.ndarray, offsets: np.ndarray, pcm: np.ndarray) -> None:
        self._write(audio_message(reqs, offsets, pcm))

    def _write(self, payload: bytes | np.ndarray) -> None:
        if self.writer.is_closing():  # the front-end is gone: its reader releases its streams
            return
        payload = memoryview(payload)  # a transport takes bytes-like objects, not arrays
        size = payload.nbytes
        self.writer.write(SIZE.pack(size) if size <= 0x7FFFFFFF else SIZE.pack(-1) + LONG_SIZE.pack(size))
        self.writer.write(payload)


def _serve_engine(address: str, settings: EngineSettings, output: str, model_options: dict, report: Connection) -> None:
    """The engine process: load, warm up, then accept front-ends until terminated."""
    # the engine, reader and sender threads take turns at the interpreter: hand it over within 1 ms,
    # not the default 5, so a push waits less for the engine thread (docs/measurements.md)
    sys.setswitchinterval(0.001)
    name_process(ENGINE_NAME)
    try:
        import torch

        from snac_fast.ops.device import make_current

        if settings.device:
            make_current(torch.device(settings.device))  # warm-up and graphs on that GPU, not the first
        codec = settings.load_codec(**model_options)
        engine, settings = ready_engine(codec, settings, settings.cpu_threads or len(os.sched_getaffinity(0)))
        on_loop = settings.calls_on_loop(engine_process=True)
        batcher = EngineBatcher(engine, settings.max_batch, settings.max_wait_ms, output, settings.idle_timeout_s,
                                event_loop=on_loop)
        listener = None if on_loop else Listener(address, family="AF_UNIX")
    except BaseException as error:  # noqa: BLE001 - the parent raises it with its message
        report.send(("failed", f"{type(error).__name__}: {error}"))
        raise SystemExit(1) from None
    freeze_startup_objects()  # a full collection would stall every stream's round
    trim_periodically(settings.memory_trim_s)
    ready = ("ready", {"sampling_rate": codec.sampling_rate, "output": output, "config": dict(codec.config),
                       "samples_per_frame": engine.samples_per_frame, "max_streams": engine.max_streams,
                       "device": str(codec.device)})
    if on_loop:
        asyncio.run(_serve_on_loop(batcher, address, report, ready))
        return
    report.send(ready)
    # one thread reads every front-end (fewer threads taking turns at the interpreter than one each)
    fronts: dict[Connection, Front] = {}
    woken, wake = socket.socketpair()
    threading.Thread(target=_read_fronts, args=(batcher, fronts, woken), name="snac-fast-engine-reader",
                     daemon=True).start()
    while True:
        conn = listener.accept()
        fronts[conn] = _ThreadFront(conn)
        wake.send(b"x")


async def _serve_on_loop(batcher: EngineBatcher, address: str, report: Connection, ready: tuple) -> None:
    """The engine process on one event loop: each front-end's messages read as they come and queued
    (:meth:`EngineBatcher.take`), the engine calls run by the batcher's loop driver between those
    reads, the replies written to each front-end's transport."""
    batcher.driver.bind(asyncio.get_running_loop())

    async def front_end(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        front = _LoopFront(writer)
        try:
            while True:  # multiprocessing.connection's framing (what EngineClient sends)
                size, = SIZE.unpack(await reader.readexactly(SIZE.size))
                if size == -1:
                    size, = LONG_SIZE.unpack(await reader.readexactly(LONG_SIZE.size))
                batcher.take(front, await reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):  # the front-end went away
            pass
        finally:
            writer.close()
            _front_gone(batcher, front)

    try:
        server = await asyncio.start_unix_server(front_end, path=address)
    except OSError as error:
        report.send(("failed", f"{type(error).__name__}: {error}"))
        raise SystemExit(1) from None
    report.send(ready)
    async with server:
        await server.serve_forever()


def _read_fronts(batcher: EngineBatcher, fronts: dict, woken: socket.socket) -> None:
    selector = selectors.DefaultSelector()  # kept: a new selector per wait costs more than the reads
    selector.register(woken, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is woken:  # new front-ends
                woken.recv(4096)
                for conn, front in list(fronts.items()):
                    if conn not in selector.get_map():
                        selector.register(conn, selectors.EVENT_READ, front)
                continue
            conn, front = key.fileobj, key.data
            try:
                batcher.take(front, conn.recv_bytes())
            except (EOFError, OSError):  # the front-end went away
                selector.unregister(conn)
                del fronts[conn]
                _front_gone(batcher, front)


def _front_gone(batcher: EngineBatcher, front: Front) -> None:
    """A front-end disconnected: no more messages to it, and the streams it held are released."""
    front.stop()
    for sid in list(front.streams):
        batcher.release(sid)


class EngineProcess:
    """The engine's process (spawned), from ``settings`` (:class:`EngineSettings`, or a
    :class:`ServeSettings` whose engine part alone is handed on): the model (``model``,
    ``device``, ``dtype``, ``local_files_only``), ``max_streams`` stream slots, engine calls of at
    most ``max_batch`` streams waiting up to ``max_wait_ms`` for them, ``idle_timeout_s``,
    ``lookahead``, and ``engine_calls`` (``"loop"``: one event loop in the engine process reads the
    front-ends, runs the engine calls and writes the replies, instead of a reader thread, an engine
    thread and a sender thread per front-end). Audio goes out as ``output`` (``"int16"`` or
    ``"float32"`` PCM). Waits until the model is loaded and warm; raises RuntimeError with the
    process's error if it fails. :attr:`address` is what
    :class:`~snac_fast.serve.engine.client.EngineClient` connects to. Close it (or use it as a
    context manager) to stop it."""

    def __init__(self, settings: EngineSettings | ServeSettings, *, output: str = "int16", model_options: dict | None = None,
                 start_timeout_s: float = 600.0) -> None:
        if output not in ENGINE_OUTPUTS:
            raise ValueError(f"output must be 'int16' or 'float32', got {output!r}")
        settings = (settings.engine if isinstance(settings, ServeSettings) else settings).check()
        self._folder = tempfile.mkdtemp(prefix="snac-fast-engine-")
        self.address = os.path.join(self._folder, "engine.sock")
        ours, theirs = mp.Pipe(duplex=False)
        self._process = mp.get_context("spawn").Process(target=_serve_engine, args=(self.address, settings, output, model_options or {}, theirs),
                                                         name="snac-fast-engine", daemon=True)
        self._process.start()
        theirs.close()
        if not ours.poll(start_timeout_s):
            self.close()
            raise RuntimeError(f"the engine process did not start within {start_timeout_s:g} s")
        try:
            status, detail = ours.recv()
        except EOFError:
            status, detail = "failed", f"it exited with code {self._process.exitcode}"
        if status != "ready":
            self.close()
            raise RuntimeError(f"the engine process failed to start: {detail}")
        self.sampling_rate = detail["sampling_rate"]
        # what a front-end needs to know of the engine without a model of its own: the model's
        # config, samples per frame, stream slots, device (its name)
        self.info = detail

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def kill(self) -> None:
        """End the process at once (SIGKILL), as a crash would."""
        self._process.kill()
        self._process.join()

    def wait(self) -> int:
        """Block until the engine process ends; its exit status (negative: the signal that ended it)."""
        self._process.join()
        return self._process.exitcode

    def close(self) -> None:
        if self._process.is_alive():
            self._process.terminate()
        self._process.join(10)
        try:
            os.unlink(self.address)
        except FileNotFoundError:
            pass
        try:
            os.rmdir(self._folder)
        except OSError:
            pass

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def ready_engine(codec, settings: EngineSettings, cpu_threads: int) -> tuple[Any, EngineSettings]:
    """The codec's shared stream engine for a worker or the engine process, ready to serve, and the
    settings it serves with: on CUDA warmed up (every step's graph), within ``--gpu-memory-gb`` if
    set (``max_batch`` then the largest batch whose step graphs fit; ValueError when none does); on
    a CPU with ``cpu_threads`` torch threads (N workers each with all the host's cores would
    oversubscribe it)."""
    import dataclasses

    import torch

    engine = codec.shared_stream_engine(settings.lookahead, max_streams=settings.max_streams)
    engine.rows_per_pass = settings.rows_per_pass or None
    if codec.device.type == "cuda":
        if settings.gpu_memory_gb:
            from snac_fast.serve.engine.gpu_memory import GB, fit_max_batch

            fitted, figures = fit_max_batch(engine, int(settings.gpu_memory_gb * GB), settings.warmup_streams)
            if fitted < settings.warmup_streams:
                print(f"snac-fast: --gpu-memory-gb {settings.gpu_memory_gb:g}: engine calls of at most {fitted} "
                      f"streams (of --max-batch {settings.max_batch}; {figures})", file=sys.stderr, flush=True)
                settings = dataclasses.replace(settings, max_batch=fitted)
        codec.warmup(streams=settings.warmup_streams, lookahead=settings.lookahead)
    elif codec.device.type == "cpu":
        torch.set_num_threads(cpu_threads)
    return engine, settings
