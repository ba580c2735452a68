"""Running the server: uvicorn in one process, or in several (:mod:`snac_fast.serve.workers`), each
building its app from the settings the parent handed on (:data:`SETTINGS_VARIABLE`), and with
``shared_engine`` one engine process that every worker feeds (:data:`ENGINE_VARIABLE`)."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading

from snac_fast.serve.access.limits import uvicorn_options
from snac_fast.serve.engine.client import EngineLostError
from snac_fast.serve.settings import ServeSettings
from snac_fast.serve.workers import check_port_free, run_workers

log = logging.getLogger("snac_fast.serve")

SETTINGS_VARIABLE = "SNAC_FAST_SERVE"  # ServeSettings.to_json(), read by each worker process
ENGINE_VARIABLE = "SNAC_FAST_SERVE_ENGINE"  # the shared engine process's address and info (JSON)
CLAIMS_VARIABLE = "SNAC_FAST_SERVE_CLAIMS"  # a folder where each worker claims its number (its GPU among several)
GRACEFUL_SHUTDOWN_S = 30
APP = "snac_fast.serve.run:app_from_environment"  # uvicorn's app factory in each worker process


def worker_device(device: str | None, claims: str | None) -> str | None:
    """The device a worker process serves on: ``device`` when one was given; else, on a host of
    several CUDA GPUs, the worker's turn among them: each worker claims the next free number in
    ``claims`` (a folder the parent made; a file created exclusively per number), and worker k takes
    GPU k modulo their count, so that N workers spread over the GPUs. Else None (the default)."""
    import torch

    if device is not None or claims is None or not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return device
    number = 0
    while True:
        try:
            os.close(os.open(os.path.join(claims, str(number)), os.O_CREAT | os.O_EXCL))
            return f"cuda:{number % torch.cuda.device_count()}"
        except FileExistsError:
            number += 1


def app_from_environment():
    """uvicorn's app factory (``snac_fast.serve.run:app_from_environment``, ``factory=True``): each
    worker process loads the model, warms it up and serves its share of the connections with its
    own engine (docs/batching.md: one engine per worker process), or feeds the shared one."""
    from snac_fast.serve.app import create_app

    settings = ServeSettings.from_json(os.environ[SETTINGS_VARIABLE])
    engine = os.environ.get(ENGINE_VARIABLE)
    if engine:  # --shared-engine: the parent runs the engine process; this worker feeds it
        engine = json.loads(engine)
        return create_app(None, settings, (engine["address"], engine["info"]))
    from snac_fast.serve.engine.process import ready_engine

    codec = settings.engine.load_codec(worker_device(settings.engine.device, os.environ.get(CLAIMS_VARIABLE)))
    _, settings.engine = ready_engine(codec, settings.engine, settings.threads_per_worker())
    return create_app(codec, settings)


def serve(settings: ServeSettings) -> None:
    """Run the server with uvicorn until it is stopped (SIGINT, SIGTERM). Without a ``device``,
    ``workers`` processes on a host of several GPUs take them in turn (:func:`worker_device`).
    ``shared_engine``: one engine process (on ``device``) that all ``workers`` feed, so every
    connection shares one batch (docs/batching.md, "One engine process, fed by front-ends"). Raises
    :class:`EngineLostError` when the engine process died under it, and
    :class:`~snac_fast.serve.workers.ServeFailure` when the port is taken or a worker fails to start."""
    import shutil
    import tempfile

    import uvicorn

    from snac_fast.serve.engine import process as engine_process

    settings.check()
    check_port_free(settings.http.host, settings.http.port)  # before the engine process loads a model
    engine, lost, closing = None, [], threading.Event()
    handed_on = {SETTINGS_VARIABLE: settings.to_json()}
    if settings.http.shared_engine:
        engine = engine_process.EngineProcess(settings.engine, output="float32")
        handed_on[ENGINE_VARIABLE] = json.dumps({"address": engine.address, "info": engine.info})

        def watch() -> None:  # an engine process that dies stops the server: its supervisor restarts it
            code = engine.wait()
            if not closing.is_set():
                lost.append(code)
                log.error("the engine process exited with code %s: stopping the server", code)
                os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful shutdown (the workers', with several)
        threading.Thread(target=watch, name="snac-fast-engine-watch", daemon=True).start()
    handed_on[CLAIMS_VARIABLE] = claims = tempfile.mkdtemp(prefix="snac-fast-serve-")
    os.environ.update(handed_on)
    # uvicorn raises the signal that stopped it again once it has shut down: ignored here, so that
    # the engine process and the folders are cleaned up and serve() returns
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if settings.http.workers > 1:  # each worker on its own SO_REUSEPORT socket: the kernel spreads the connections
            run_workers(APP, settings.http.host, settings.http.port, settings.http.workers, GRACEFUL_SHUTDOWN_S,
                        limits=settings.http)
        else:
            uvicorn.run(APP, factory=True, host=settings.http.host, port=settings.http.port,
                        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, log_level="info", **uvicorn_options(settings.http))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        closing.set()
        shutil.rmtree(claims, ignore_errors=True)
        for name in handed_on:
            os.environ.pop(name, None)
        if engine is not None:
            engine.close()
    if lost:
        raise EngineLostError(f"the engine process exited with code {lost[0]}; the server stopped")
