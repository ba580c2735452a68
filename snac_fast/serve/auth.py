"""API keys: ``Authorization: Bearer KEY`` (or ElevenLabs' ``xi-api-key: KEY``) on every HTTP and
WebSocket route but the open ones (``/health``, the page at ``/``), answered in OpenAI's error shape (401,
``invalid_api_key``) before any handler runs."""

from __future__ import annotations

import hashlib
import hmac
import json

OPEN_PATHS = frozenset({"/health", "/"})  # liveness, and the page (it asks for the key itself)


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class BearerKey:
    """ASGI middleware: requests without the key get a 401 (HTTP) or a 1008 close before accepting
    (WebSocket); keys are compared as SHA-256 digests in constant time (neither content nor length
    shows in the time taken)."""

    def __init__(self, app, key: str, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app, self.open_paths = app, open_paths
        self._key = _digest(key.encode())

    def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """``Authorization: Bearer KEY``, or ElevenLabs' ``xi-api-key: KEY`` (their clients send it)."""
        given = next((v for k, v in headers if k == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        if hmac.compare_digest(_digest(token.strip()), self._key) and scheme.lower() == b"bearer":
            return True
        xi = next((v for k, v in headers if k == b"xi-api-key"), None)
        return xi is not None and hmac.compare_digest(_digest(xi.strip()), self._key)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in self.open_paths \
                or self.allowed(scope.get("headers", [])):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008, "reason": "invalid or missing API key"})
            return
        body = json.dumps({"error": {"message": "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                     "type": "invalid_request_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
