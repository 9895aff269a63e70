"""ASGI middleware, before any parsing: Host allow-list, API keys, body size, JSON type.

Two credentials: the client key (``--api-key``) opens the serving routes under ``/v1``;
the admin key (``--admin-key``, the fleet's router/replica credential) opens everything,
and, when set, is the only key that opens the operator routes (``ADMIN_PATHS``). Without
an admin key the client key opens those too (a single server, as before).
"""

from __future__ import annotations

import asyncio
import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import error_response

# Operator and router routes: what a client must not call once the fleet has an admin key
# (flush every replica's cache, read the model path and device, poll the loads).
ADMIN_PATHS = frozenset({"/flush_cache", "/server_info", "/model_info", "/v1/loads"})
# A rejected body larger than this is not drained: the connection is simply closed.
MAX_DRAIN_BYTES = 64 * 1024 * 1024


def needs_key(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path in ADMIN_PATHS


def allowed_keys(
    path: str, api_key: bytes | None, admin_key: bytes | None, metrics_public: bool = False
) -> tuple[bytes, ...]:
    """The keys that open ``path``; empty: the route is open to anyone."""
    if path in ADMIN_PATHS:
        if admin_key is not None:
            return (admin_key,)
        return (api_key,) if api_key is not None else ()
    client_route = needs_key(path) or (path == "/metrics" and not metrics_public)
    if not client_route or api_key is None:
        return ()
    return (api_key, admin_key) if admin_key is not None else (api_key,)


def _header(scope: Scope, wanted: bytes) -> bytes | None:
    for name, value in scope.get("headers", []):
        if name.lower() == wanted:
            return bytes(value)
    return None


def bearer_matches(authorization: bytes | None, *keys: bytes) -> bool:
    """Whether an ``Authorization`` header carries one of ``keys`` as a bearer token."""
    scheme, _, token = (authorization or b"").partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    # Constant-time compares, all of them: the time taken does not leak which key, or how
    # much of one, matched.
    matches = [hmac.compare_digest(token.strip(), key) for key in keys]
    return any(matches)


def host_name(host_header: str) -> str:
    """``"Example.com:8000"`` -> ``"example.com"``; ``"[::1]:8000"`` -> ``"[::1]"``."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_allowed(host_header: str | None, allowed: tuple[str, ...]) -> bool:
    """``allowed`` entries are host names (no port) or ``*.suffix`` wildcards."""
    if not allowed:
        return True
    if not host_header:
        return False
    host = host_name(host_header)
    for entry in allowed:
        if entry == "*" or host == entry:
            return True
        if entry.startswith("*.") and host.endswith(entry[1:]):
            return True
    return False


def is_json_type(content_type: bytes | None) -> bool:
    if content_type is None:
        return False
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json"


class GuardMiddleware:
    """401 without the right bearer key on protected routes; 413 past ``max_body_bytes``.

    NOTE: the body is buffered here (it is at most ``max_body_bytes``) and replayed to the
    app; after the replay, ``receive`` is the server's again, so the app still sees
    ``http.disconnect`` when the client goes away.
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        allowed_hosts: tuple[str, ...] = (),
        admin_key: str | None = None,
        metrics_public: bool = False,
        body_timeout: float | None = None,
    ) -> None:
        self.app = app
        self.body_timeout = body_timeout
        self.api_key = api_key.encode("utf-8") if api_key else None
        self.admin_key = admin_key.encode("utf-8") if admin_key else None
        self.metrics_public = metrics_public
        self.max_body_bytes = max_body_bytes
        self.allowed_hosts = allowed_hosts

    def _authorized(self, scope: Scope) -> bool:
        keys = allowed_keys(
            scope.get("path", ""), self.api_key, self.admin_key, self.metrics_public
        )
        return not keys or bearer_matches(_header(scope, b"authorization"), *keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # /health stays reachable under any Host: probes address pods by IP, and what it
        # shows without the key is only whether the server is up.
        if scope.get("path") != "/health":
            host = _header(scope, b"host")
            if not host_allowed(host.decode("latin-1") if host else None, self.allowed_hosts):
                response = error_response(
                    400,
                    "this server does not answer for that Host header (--allowed-hosts)",
                    code="invalid_host",
                )
                await response(scope, receive, send)
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
        loop = asyncio.get_running_loop()
        deadline = None if self.body_timeout is None else loop.time() + self.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(
                    receive(), None if deadline is None else max(0.0, deadline - loop.time())
                )
            except asyncio.TimeoutError:
                # NOTE: a body sent a byte at a time would hold the connection (and the
                # buffer) as long as the sender likes.
                response = error_response(
                    408,
                    f"the request body did not arrive within {self.body_timeout:.0f} s "
                    "(--body-timeout)",
                    code="body_timeout",
                    headers={"Connection": "close"},
                )
                await response(scope, receive, send)
                return
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
        if size and not is_json_type(_header(scope, b"content-type")):
            # NOTE: a cross-site form or fetch() may send text/plain without a preflight;
            # requiring the JSON type forces the preflight that browsers never pass here.
            response = error_response(
                415,
                "the request body must be JSON sent with Content-Type: application/json",
                code="unsupported_media_type",
            )
            await response(scope, receive, send)
            return
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
        value = _header(scope, b"content-length")
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
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
