"""The serving tests' live servers: an ASGI app on uvicorn in a thread, on the loopback."""

import contextlib
import threading
import time

import uvicorn

from snac_fast.serve import ServeSettings, create_app
from snac_fast.serve.access.limits import uvicorn_options
from snac_fast.serve.lm.fake import FakeLM


class LiveServer:
    """An ASGI app served by uvicorn on 127.0.0.1 (an ephemeral port) in a thread."""

    def __init__(self, app, **options) -> None:
        """``options``: more of uvicorn's (``ssl_certfile`` and ``ssl_keyfile``: https and wss)."""
        self.tls = "ssl_certfile" in options
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    timeout_graceful_shutdown=120, **options))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@contextlib.contextmanager
def serving(codec, tls: dict | None = None, lm_options: dict | None = None, **options):
    """A live server of ``codec`` with ``options`` (ServeSettings' names) before a FakeLM of
    ``lm_options``: yields (server, fake LM, the app's SpeechServer)."""
    lm = FakeLM(split_tokens=True, **(lm_options or {}))
    with LiveServer(lm.app) as lm_server:
        config = ServeSettings.of(lm_url=lm_server.url + "/v1", lm_model="orpheus", **options)
        app = create_app(codec, config)
        with LiveServer(app, **uvicorn_options(config.http), **(tls or {})) as server:
            yield server, lm, app.state.server
