"""The limits a server on a network needs and uvicorn does not set for it (docs/http_server.md,
"Limits"): request body size (:class:`BodyLimit`), open streams per client (:class:`StreamOwners`),
WebSocket message rate (:class:`MessageRate`), and the time a connection may take to send its
request's headers (:func:`header_timeout_protocol`). WebSocket message size is uvicorn's own
``ws_max_size``; the input's length and the idle WebSocket are the routes'."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

from snac_fast.serve.access.auth import send_error
from snac_fast.serve.settings import HTTPSettings


class TooManyStreams(Exception):
    """A client holds its most streams already (``--max-streams-per-key``)."""


def client_of(scope) -> str:
    """Who a request is, for the per-client limits: its API key (set by
    :class:`~snac_fast.serve.access.auth.BearerKey`), else its address."""
    client = (scope.get("state") or {}).get("client")
    if client:
        return client
    address = scope.get("client")
    return f"address {address[0]}" if address else "address unknown"


class StreamOwners:
    """Open streams per client, at most ``limit`` each (0: no limit)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open: Counter[str] = Counter()
        self._owner: dict[int, str] = {}

    def check(self, client: str) -> None:
        """Raise :class:`TooManyStreams` if ``client`` may open no more streams."""
        if self.limit and self.open[client] >= self.limit:
            raise TooManyStreams(f"this client holds {self.open[client]} streams, the most it may "
                                 f"(--max-streams-per-key {self.limit}); retry when one ends")

    def add(self, sid: int, client: str) -> None:
        self._owner[sid] = client
        self.open[client] += 1

    def done(self, sid: int) -> None:
        """A stream has ended (any way): its client's count goes down, once."""
        client = self._owner.pop(sid, None)
        if client is not None:
            self.open[client] -= 1
            if not self.open[client]:
                del self.open[client]


class MessageRate:
    """A token bucket: ``per_second`` messages sustained, twice as many in a burst."""

    def __init__(self, per_second: float) -> None:
        self.rate, self.capacity = per_second, 2 * per_second
        self.tokens, self.at = self.capacity, time.monotonic()

    def allow(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class BodyLimit:
    """ASGI middleware: an HTTP request body past ``max_bytes`` gets a 413 in OpenAI's error shape
    before any route reads it (by its Content-Length, or as it arrives without one); one that takes
    longer than ``timeout_s`` to arrive gets a 408 (a Content-Length of 100 with 13 bytes sent held
    its connection open for good)."""

    def __init__(self, app, max_bytes: int, timeout_s: float = 10.0) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(send)
            return
        messages, size = [], 0
        deadline = time.monotonic() + self.timeout_s
        while True:  # the body, buffered up to the limit (the routes read it whole anyway)
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                await send_error(send, 408, f"the request body did not arrive within {self.timeout_s:g} s",
                                 "request_timeout", [(b"connection", b"close")])
                return
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._too_large(send)
                return
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()
        await self.app(scope, replay, send)

    async def _too_large(self, send) -> None:
        await send_error(send, 413, f"the request body is larger than {self.max_bytes} bytes", "request_too_large",
                         [(b"connection", b"close")])


MAX_HEADER_BYTES = 64 << 10  # a request line and headers past this get a 431 (a 16 MB header was served)


def header_timeout_protocol(timeout_s: float, max_header_bytes: int = MAX_HEADER_BYTES):
    """uvicorn's httptools protocol, with a connection that takes more than ``timeout_s`` to send a
    request's headers (from its first byte, or from the connection's start) closed: a client that
    trickles its headers (slowloris) holds nothing for long; and one whose request line and headers
    pass ``max_header_bytes`` answered 431 and closed (httptools sets no limit). uvicorn's own
    timeouts cover idle keep-alive connections, not slow headers."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(timeout_s, self._headers_too_slow)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._header_timer is not None:  # the headers still arriving after this chunk
                self._header_bytes += len(data)
                if self._header_bytes > max_header_bytes:
                    self._headers_too_large()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._header_timer is None:  # a later request on a kept-alive connection
                self._header_bytes = 0
                self._header_timer = self.loop.call_later(timeout_s, self._headers_too_slow)

        def on_headers_complete(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def _headers_too_large(self) -> None:
            self._header_timer.cancel()
            self._header_timer = None
            if self.transport.is_closing():
                return
            body = json.dumps({"error": {"message": f"the request's headers pass {max_header_bytes} bytes",
                                         "type": "invalid_request_error", "param": None,
                                         "code": "headers_too_large"}}).encode()
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return HeaderTimeoutProtocol


def uvicorn_options(settings: HTTPSettings) -> dict:
    """The uvicorn options the settings set: the WebSocket message size and compression, the
    keep-alive timeout, and the header timeout where uvicorn runs httptools (``serve``'s extra
    installs it)."""
    options = {"ws_max_size": settings.max_ws_message_bytes, "timeout_keep_alive": settings.keep_alive_s,
               "ws_per_message_deflate": settings.ws_compression}
    try:
        options["http"] = header_timeout_protocol(settings.header_timeout_s)
    except ImportError:  # h11 only: no header timeout
        pass
    return options
