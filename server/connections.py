"""Connection limits below the app, in uvicorn's HTTP/1.1 protocol (issue 25 item 6).

Four things a client could do without a key, and what ends each:

- open thousands of connections until the process runs out of descriptors: past
  ``max_connections`` in all, or ``max_connections_per_client`` from one address, a new
  connection gets a 503 and is closed at once;
- send request headers a byte at a time (slowloris): a connection that has not sent
  complete headers ``header_timeout`` seconds after it opened (or after its last response)
  gets a 408 and is closed;
- read nothing from a stream while the server writes to it: the socket's send buffer is
  kept small (``send_buffer_bytes``), so it fills within a few hundred tokens; a write that
  stays blocked for ``send_timeout`` seconds aborts the connection, the app sees a
  disconnect, and the engine request ends, freeing its running slot and its KV;
- make each of those errors log a traceback: the warnings here go through
  ``server.log_limits``, which lets a few of each kind through per window.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # uvicorn's protocol on httptools' C parser, where it is installed (a dependency)
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - httptools missing: the pure-Python h11 one
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

logger = logging.getLogger("hiserve.connections")

_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\nretry-after: 1\r\n"
    b"content-type: text/plain\r\ncontent-length: 33\r\n\r\ntoo many connections; retry later\n"
)
_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-type: text/plain\r\n"
    b"content-length: 41\r\n\r\nrequest headers not received in time; bye\n"
)


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client, and all clients together, may hold open (see the module doc)."""

    max_connections: int = 4096
    max_connections_per_client: int = 256  # 0: no per-address cap
    header_timeout: float = 10.0
    send_timeout: float = 15.0
    send_buffer_bytes: int = 64 * 1024  # 0: the system's (auto-tuned) buffer


class ConnectionGuard:
    """The limits of ``ConnectionLimits`` over one of uvicorn's HTTP/1.1 protocols (mixed
    in before it by ``guarded_protocol``; uvicorn builds one instance per connection).
    Both protocols start a request cycle once its headers are complete and call
    ``on_response_complete``, ``pause_writing`` and ``resume_writing`` the same way.
    """

    # What the protocol under it provides.
    cycle: Any
    client: Any
    connections: set[Any]
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    per_client: ClassVar[Counter[str]] = Counter()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self._peer: str | None = None
        self._header_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        peer = self.client[0] if self.client else ""
        self._peer = peer
        self.per_client[peer] += 1
        cap = self.limits.max_connections_per_client
        if len(self.connections) > self.limits.max_connections or (
            cap and self.per_client[peer] > cap
        ):
            logger.warning(
                "refused a connection from %s: %d open from it, %d in all (caps: "
                "--max-connections-per-client %d, --max-connections %d)",
                peer,
                self.per_client[peer] - 1,
                len(self.connections) - 1,
                cap,
                self.limits.max_connections,
            )
            transport.write(_BUSY)
            transport.close()
            return
        size = self.limits.send_buffer_bytes
        if size:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
            transport.set_write_buffer_limits(high=size)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._stall_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._stall_timer = None
        if self._peer is not None:
            self.per_client[self._peer] -= 1
            if self.per_client[self._peer] <= 0:
                del self.per_client[self._peer]
            self._peer = None
        super().connection_lost(exc)  # type: ignore[misc]

    # ------------------------------------------------------------------ headers
    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(
            self.limits.header_timeout, self._headers_overdue, self.cycle
        )

    def _headers_overdue(self, cycle_when_armed: Any) -> None:
        self._header_timer = None
        # NOTE: a new request cycle starts when its headers are complete; the same cycle
        # as when armed (None, or a finished one) means none has arrived since.
        waiting = self.cycle is None or self.cycle.response_complete
        if self.cycle is not cycle_when_armed or not waiting or self.transport.is_closing():
            return
        logger.warning(
            "closed a connection from %s: no complete request headers within %.0f s "
            "(--header-timeout)",
            self._peer,
            self.limits.header_timeout,
        )
        self.transport.write(_TIMEOUT)
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():
            self._arm_header_timer()  # the next request's headers have the same deadline

    # ------------------------------------------------------------------ writes
    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.limits.send_timeout, self._send_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()  # type: ignore[misc]
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _send_stalled(self) -> None:
        self._stall_timer = None
        logger.warning(
            "aborted a connection from %s: it read nothing for %.0f s while a response "
            "waited to be written (--send-timeout)",
            self._peer,
            self.limits.send_timeout,
        )
        # NOTE: abort, not close: close would wait to flush a buffer nobody reads. The
        # cycle sees a disconnect, so the app ends the engine request.
        self.transport.abort()


def guarded_protocol(
    limits: ConnectionLimits, base: type[asyncio.Protocol] | None = None
) -> type[asyncio.Protocol]:
    """A protocol class bound to ``limits``, with its own per-address tally, over ``base``:
    by default uvicorn's httptools protocol where httptools is installed, else its h11 one.

    NOTE: httptools parses in C and frames a streamed chunk in a few lines; h11 does both
    in Python, about a tenth of the HTTP thread's CPU at 32 streams (2026-12-06, `py-spy
    --gil`). uvicorn picks httptools by default for the same reason.
    """
    if base is None:
        base = HttpToolsProtocol if HttpToolsProtocol is not None else H11Protocol
    guarded: type[asyncio.Protocol] = type(
        f"Guarded{base.__name__}",
        (ConnectionGuard, base),
        {"limits": limits, "per_client": Counter()},
    )
    return guarded
