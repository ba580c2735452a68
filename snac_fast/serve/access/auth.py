"""API keys: ``Authorization: Bearer KEY`` (or ElevenLabs' ``xi-api-key: KEY``) on every HTTP and
WebSocket route but the open ones (``/health``, the page at ``/``), answered in OpenAI's error shape (401,
``invalid_api_key``) before any handler runs. Browsers' origins: a request or WebSocket that a page of
another site makes (its ``Origin`` header) is refused unless ``--allow-origins`` names that site."""

from __future__ import annotations

import hashlib
import hmac
import json

DOCS_PREFIX = "/docs"  # Swagger UI's page and assets
# liveness, the page (it asks for the key itself), the schema and its page; and what is below the docs
OPEN_PATHS = frozenset({"/health", "/", "/openapi.json", DOCS_PREFIX})
OPEN_PREFIXES = (DOCS_PREFIX + "/",)


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class BearerKey:
    """ASGI middleware: requests without the key get a 401 (HTTP) or a 1008 close before accepting
    (WebSocket); keys are compared as SHA-256 digests in constant time (neither content nor length
    shows in the time taken)."""

    def __init__(self, app, key: str, open_paths: frozenset[str] = OPEN_PATHS,
                 open_prefixes: tuple[str, ...] = OPEN_PREFIXES) -> None:
        """``key``: one key, or several separated by commas (each a client of its own, for the
        per-key limits)."""
        self.app, self.open_paths, self.open_prefixes = app, open_paths, open_prefixes
        self._keys = [_digest(k.strip().encode()) for k in key.split(",") if k.strip()]

    def key_index(self, headers: list[tuple[bytes, bytes]]) -> int | None:
        """Which key the request holds (``Authorization: Bearer KEY``, or ElevenLabs' ``xi-api-key:
        KEY``, which their clients send), or None. Every key is compared, each in constant time."""
        given = next((v for k, v in headers if k == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        candidates = [token.strip()] if scheme.lower() == b"bearer" else []
        xi = next((v for k, v in headers if k == b"xi-api-key"), None)
        if xi is not None:
            candidates.append(xi.strip())
        found = None
        for candidate in candidates:
            digest = _digest(candidate)
            for n, key in enumerate(self._keys):
                if hmac.compare_digest(digest, key) and found is None:
                    found = n
        return found

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        index = self.key_index(scope.get("headers", []))
        path = scope["path"]
        if index is not None or path in self.open_paths or path.startswith(self.open_prefixes):
            if index is not None:  # the client, for the per-key limits (request.state.client)
                scope.setdefault("state", {})["client"] = f"key {index}"
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008, "reason": "invalid or missing API key"})
            return
        await send_error(send, 401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                         "invalid_api_key", [(b"www-authenticate", b"Bearer")])


async def send_error(send, status: int, message: str, code: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    """An error in OpenAI's shape sent from ASGI middleware (before any route)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> str | None:
    value = next((v for k, v in scope.get("headers", []) if k == name), None)
    return value.decode("latin-1") if value is not None else None


class OriginCheck:
    """ASGI middleware: what a browser sends with another site's ``Origin`` is refused (HTTP 403 in
    OpenAI's shape; a WebSocket closed 1008 before it opens), unless ``allowed`` names that origin
    (or holds ``*``). Requests without an ``Origin`` (the SDKs, curl) and the server's own page pass.
    Without it a page anywhere could make a keyless server speak (a cross-origin ``text/plain``
    POST needs no preflight) and open its WebSockets."""

    def __init__(self, app, allowed: frozenset[str]) -> None:
        self.app, self.allowed = app, frozenset(o.rstrip("/") for o in allowed)

    def allows(self, origin: str, scope) -> bool:
        if "*" in self.allowed or origin in self.allowed:
            return True
        host = _header(scope, b"host")  # the server's own page: the origin is the host it asked
        scheme = "https" if scope.get("scheme") in ("https", "wss") else "http"
        return host is not None and origin == f"{scheme}://{host}"

    async def __call__(self, scope, receive, send) -> None:
        origin = _header(scope, b"origin") if scope["type"] in ("http", "websocket") else None
        if origin is None or self.allows(origin, scope):
            await self.app(scope, receive, send)
            return
        message = f"requests from the web origin {origin[:100]!r} are not allowed (see --allow-origins)"
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
            return
        await send_error(send, 403, message, "origin_not_allowed")
