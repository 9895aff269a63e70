"""Connection exhaustion without a key (issue 25 item 6), on the fake engine served by the
server's own uvicorn settings (``uvicorn_config``): slow headers and bodies are dropped,
connections past the caps are refused at once, a stream nobody reads is aborted and frees
its engine request, and the warnings about all of it stay a handful."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from engine.config import EngineConfig
from server import connections
from server.__main__ import uvicorn_config
from server.app import create_app
from server.args import ServerArgs
from server.log_limits import RepeatLimitFilter
from tests.integration.fake_engine import FakeEngine

KEY = "conn-key"
ATTACKER = "127.0.0.2"  # any 127.x address reaches the loopback listener
SLOW_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


@pytest.fixture(autouse=True, params=["httptools", "h11"])
def protocol(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test on both of uvicorn's protocols: httptools' (the default) and h11's (the
    fallback where httptools is not installed)."""
    if request.param == "h11":
        monkeypatch.setattr(connections, "HttpToolsProtocol", None)
    return str(request.param)


def test_the_guard_is_over_the_chosen_protocol(protocol: str) -> None:
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    cls = connections.guarded_protocol(connections.ConnectionLimits())
    assert issubclass(cls, connections.ConnectionGuard)
    assert issubclass(cls, HttpToolsProtocol if protocol == "httptools" else H11Protocol)
    assert cls.__mro__.index(connections.ConnectionGuard) == 1  # its hooks come first


@contextlib.contextmanager
def _serve(tools: SimpleNamespace, **kw: Any) -> Iterator[tuple[FakeEngine, Any]]:
    holder: dict[str, FakeEngine] = {}

    def factory(config: EngineConfig) -> FakeEngine:
        holder["engine"] = FakeEngine(config, step_delay=0.001)
        return holder["engine"]

    args = ServerArgs(engine=EngineConfig(), api_key=KEY, log_level="warning", **kw)
    app = create_app(args, engine_factory=factory)
    with tools.ThreadServer(app, config=uvicorn_config(app, args)) as srv:
        assert tools.wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 200)
        yield holder["engine"], srv


def _canary(srv: Any) -> None:
    """A client that behaves is served while the attack goes on."""
    resp = httpx.post(
        srv.base_url + "/v1/completions",
        json={"prompt": "The sky is", "max_tokens": 2},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text


def _connect(srv: Any, source: str = ATTACKER, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect: the window is set at the handshake
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((source, 0))
    sock.settimeout(20)
    sock.connect(("127.0.0.1", srv.port))
    return sock


def _status(sock: socket.socket) -> bytes:
    """The status line the server answered with (b"" if it only closed)."""
    try:
        return sock.recv(64).split(b"\r\n", 1)[0]
    except TimeoutError:
        return b"<no answer>"
    finally:
        sock.close()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings_logged() -> Iterator[_Records]:
    records = _Records()
    target = logging.getLogger("hiserve.connections")
    # A fresh repeat limit (the app installs one if none is there): an earlier test's
    # warnings of the same kind would hold this test's back for the rest of the window.
    for limit in [f for f in target.filters if isinstance(f, RepeatLimitFilter)]:
        target.removeFilter(limit)
    target.addHandler(records)
    yield records
    target.removeHandler(records)


def test_slow_headers_are_dropped_and_extra_connections_refused(
    tools: SimpleNamespace, warnings_logged: _Records
) -> None:
    with _serve(tools, max_connections_per_client=4, header_timeout=0.5) as (_, srv):
        socks = []
        for _ in range(20):
            sock = _connect(srv)
            sock.sendall(SLOW_HEAD)  # and never the rest
            socks.append(sock)
        _canary(srv)
        answers = Counter(_status(sock) for sock in socks)
    assert set(answers) <= {b"HTTP/1.1 503 Service Unavailable", b"HTTP/1.1 408 Request Timeout"}
    assert answers[b"HTTP/1.1 408 Request Timeout"] >= 1, answers
    assert answers[b"HTTP/1.1 503 Service Unavailable"] >= 1, answers
    refusals = [m for m in warnings_logged.messages if m.startswith("refused a connection")]
    # 16 or so refusals, a burst of them logged, never a traceback each
    assert 1 <= len(refusals) <= RepeatLimitFilter().burst, warnings_logged.messages


def test_total_connection_cap(tools: SimpleNamespace) -> None:
    with _serve(tools, max_connections=6, max_connections_per_client=0, header_timeout=30) as (
        _,
        srv,
    ):
        held = [_connect(srv, f"127.0.0.{10 + i}") for i in range(6)]
        with contextlib.closing(_connect(srv, "127.0.0.30")) as extra:
            assert _status(extra) == b"HTTP/1.1 503 Service Unavailable"
        for sock in held:
            sock.close()
        assert tools.wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 200)


def test_slow_body_gets_408(tools: SimpleNamespace) -> None:
    with _serve(tools, body_timeout=0.5) as (_, srv):
        sock = _connect(srv)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + f"Authorization: Bearer {KEY}\r\n".encode()
            + b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"prompt"'
        )
        assert _status(sock) == b"HTTP/1.1 408 Request Timeout"
        _canary(srv)


def test_a_stream_nobody_reads_is_aborted(tools: SimpleNamespace) -> None:
    """The reader's buffers fill within a few tokens (small send buffer); the write then
    stays blocked, and after --send-timeout the connection and its engine request end."""
    with _serve(tools, send_timeout=0.5, send_buffer_bytes=4096) as (engine, srv):
        body = json.dumps(
            {"prompt": "Tell a story.", "n": 8, "max_tokens": 200, "logprobs": 2, "stream": True}
        ).encode()
        sock = _connect(srv, rcvbuf=1024)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        try:
            assert tools.wait_until(lambda: len(engine.calls) == 8, timeout=10)
            # never read: the 8 copies must end well before their 200 tokens would
            assert tools.wait_until(lambda: len(engine.aborted) == 8, timeout=20), engine.running
            assert not engine.running
            _canary(srv)
        finally:
            sock.close()
