"""ASGI middleware: API-key check and request body size limit, before any parsing."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import error_response

# Routes outside /v1 that need the key too.
ADMIN_PATHS = frozenset({"/flush_cache"})
# A rejected body larger than this is not drained: the connection is simply closed.
MAX_DRAIN_BYTES = 64 * 1024 * 1024


def needs_key(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path in ADMIN_PATHS


class GuardMiddleware:
    """401 without the right bearer key on protected routes; 413 past ``max_body_bytes``.

    NOTE: the body is buffered here (it is at most ``max_body_bytes``) and replayed to the
    app; after the replay, ``receive`` is the server's again, so the app still sees
    ``http.disconnect`` when the client goes away.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode("utf-8") if api_key else None
        self.max_body_bytes = max_body_bytes

    def _authorized(self, scope: Scope) -> bool:
        if self.api_key is None or not needs_key(scope.get("path", "")):
            return True
        header = b""
        for name, value in scope.get("headers", []):
            if name.lower() == b"authorization":
                header = value
                break
        scheme, _, token = header.partition(b" ")
        # Constant-time compare: the time taken does not leak how much of the key matched.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            response = error_response(
                401,
                "invalid or missing API key; send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        declared = self._content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            if declared <= MAX_DRAIN_BYTES:
                await self._drain(receive, MAX_DRAIN_BYTES)
            await self._too_large(scope, receive, send)
            return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # client gone before the body arrived: nothing to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                if message.get("more_body", False):
                    await self._drain(receive, MAX_DRAIN_BYTES - size)
                await self._too_large(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    def _content_length(scope: Scope) -> int | None:
        for name, value in scope.get("headers", []):
            if name.lower() == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None
        return None

    @staticmethod
    async def _drain(receive: Receive, budget: int) -> None:
        """Read and drop up to ``budget`` bytes of body, so the client sees our 413 rather
        than a connection reset while it is still sending."""
        while budget > 0:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                return
            budget -= len(message.get("body", b""))

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413,
            f"request body is larger than the limit of {self.max_body_bytes} bytes",
            code="request_too_large",
        )
        await response(scope, receive, send)
