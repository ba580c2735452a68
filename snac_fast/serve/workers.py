"""``serve --workers N``: N uvicorn servers, each in its own process and listening on its own
``SO_REUSEPORT`` socket on the one port, so that the kernel spreads the connections over them (by a
hash of each connection's addresses).

uvicorn's own workers share one listening socket, and the process that wakes first takes every
connection queued (asyncio accepts up to the backlog at each wake-up): a burst of 256 clients
landed 196 / 39 / 14 / 7 on four workers, and the worker holding 196 streams could not encode its
mp3 at real time (docs/http_server.md, "Processes"). This supervisor keeps what uvicorn's gave: a worker
that dies is replaced, one that dies before it ever served stops the server, SIGINT and SIGTERM
stop every worker gracefully.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import socket
import sys
import threading
import time

log = logging.getLogger("snac_fast.serve")

POLL_S = 0.2  # how often the parent looks at its workers
STARTUP_FAILURE = 3  # uvicorn's exit status for a server that failed to start


class ServeFailure(RuntimeError):
    """The server could not start or stopped on a failure (a port in use, a worker that failed to
    start); the message says which."""


def listen_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple]:
    """The socket family and address to bind for ``host`` and ``port`` (IPv4 or IPv6)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return family, address


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`ServeFailure` when another socket listens on ``host:port`` (with
    ``SO_REUSEPORT`` workers, a second server on the same port would otherwise share it silently)."""
    family, address = listen_address(host, port)
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed server's TIME_WAIT is no obstacle
        try:
            probe.bind(address)
        except OSError as e:
            raise ServeFailure(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _shared_socket(family: socket.AddressFamily, address: tuple) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    return sock


def _worker(app: str, family: socket.AddressFamily, address: tuple, ready, graceful_s: float, log_level: str,
            limits) -> None:
    """One worker process: uvicorn on its own ``SO_REUSEPORT`` socket, which starts listening only
    once the app has started (its model loaded and warmed up), so no connection waits on a worker
    that cannot serve it yet. ``limits``: settings for :func:`~snac_fast.serve.access.limits.uvicorn_options`."""
    import uvicorn

    from snac_fast.runtime.process_name import WORKER_NAME, name_process
    from snac_fast.serve.access.limits import uvicorn_options

    name_process(WORKER_NAME)

    options = uvicorn_options(limits) if limits is not None else {}
    config = uvicorn.Config(app, factory=True, timeout_graceful_shutdown=graceful_s, log_level=log_level, **options)
    server = uvicorn.Server(config)

    def tell_when_started() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            ready.set()
    threading.Thread(target=tell_when_started, daemon=True).start()
    server.run(sockets=[_shared_socket(family, address)])  # asyncio's create_server calls listen()
    if not server.started:
        sys.exit(STARTUP_FAILURE)


def run_workers(app: str, host: str, port: int, workers: int, graceful_s: float, log_level: str = "info",
                limits=None) -> None:
    """Serve ``app`` (an import string of an app factory) from ``workers`` processes on ``host:port``
    until SIGINT or SIGTERM. ``limits``: the settings whose limits uvicorn enforces (a
    :class:`~snac_fast.serve.ServeSettings`). Raises :class:`ServeFailure` when the port is taken
    or a worker fails before it ever served."""
    check_port_free(host, port)
    family, address = listen_address(host, port)
    # held, bound and never listening, by the parent: the port stays this server's while a worker
    # is replaced (a bound socket that does not listen takes no connections)
    holder = _shared_socket(family, address)
    context = mp.get_context("spawn")  # no CUDA, no event loop carried into a child
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in (signal.SIGINT, signal.SIGTERM)}

    def start() -> tuple:
        ready = context.Event()
        process = context.Process(target=_worker, args=(app, family, address, ready, graceful_s, log_level, limits),
                                  name="snac-fast-serve-worker")
        process.start()
        return process, ready
    running = [start() for _ in range(workers)]
    failure = None
    try:
        while not stopping.wait(POLL_S):
            for k, (process, ready) in enumerate(running):
                if process.is_alive():
                    continue
                if not ready.is_set():
                    failure = f"a worker process failed to start (exit code {process.exitcode}); its log is above"
                    stopping.set()
                    break
                log.error("worker process %d exited with code %s: starting another", process.pid, process.exitcode)
                running[k] = start()
    finally:
        for process, _ in running:
            if process.is_alive():
                process.terminate()  # SIGTERM: uvicorn's graceful shutdown
        deadline = time.monotonic() + graceful_s + 10
        for process, _ in running:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        holder.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure:
        raise ServeFailure(failure)
