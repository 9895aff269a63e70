"""A client that goes away aborts what it asked for, wherever the request is: on the chat
route, before the first token, in every member of an ``n`` > 1 fan-out, and while the
body is still uploading (then nothing reaches the engine at all).

The scripted engine records aborts; raw sockets give exact control over when the client
leaves. Waiting is by polling the engine's recorded state, never by sleeping.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from engine.config import EngineConfig
from server.app import create_app
from server.args import ServerArgs
from tests.integration.fake_engine import FakeEngine

KEY = "disconnect-key"
CHAT = [{"role": "user", "content": "hi"}]
Fake = tuple[FakeEngine, Any]


@pytest.fixture
def fake(tools: SimpleNamespace) -> Iterator[Fake]:
    holder: dict[str, FakeEngine] = {}

    def factory(config: EngineConfig) -> FakeEngine:
        holder["engine"] = FakeEngine(config, step_delay=0.05)  # 200 tokens: ~10 s
        return holder["engine"]

    args = ServerArgs(engine=EngineConfig(), api_key=KEY, max_body_bytes=4096)
    with tools.ThreadServer(create_app(args, engine_factory=factory)) as srv:
        assert tools.wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 200)
        yield holder["engine"], srv


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def _all_aborted(engine: FakeEngine, count: int, tools: SimpleNamespace) -> None:
    """``count`` requests aborted, none left running: well before they could have ended."""
    assert tools.wait_until(lambda: len(engine.aborted) == count and not engine.running, 5), (
        engine.aborted,
        engine.running,
    )


def _raw_request(
    srv: Any, path: str, body: bytes, content_length: int | None = None
) -> socket.socket:
    """Send a POST over a plain socket (headers and ``body``), leaving it open."""
    sock = socket.create_connection(("127.0.0.1", srv.port))
    length = len(body) if content_length is None else content_length
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def _first_event(lines: Iterator[str]) -> dict[str, Any]:
    for line in lines:
        if line.startswith("data: {"):
            return dict(json.loads(line[len("data: ") :]))
    raise AssertionError("the stream ended without an event")


def test_chat_stream_closed_aborts(fake: Fake, tools: SimpleNamespace) -> None:
    engine, srv = fake
    body = {"messages": CHAT, "max_tokens": 200, "stream": True}
    with httpx.stream(
        "POST", srv.base_url + "/v1/chat/completions", headers=_auth(), json=body
    ) as resp:
        lines = resp.iter_lines()  # kept referenced: see test_server_fake
        first = _first_event(lines)
        assert first["object"] == "chat.completion.chunk"
        assert len(engine.running) == 1
    _all_aborted(engine, 1, tools)


def test_chat_plain_request_abandoned_aborts(fake: Fake, tools: SimpleNamespace) -> None:
    engine, srv = fake
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            srv.base_url + "/v1/chat/completions",
            headers=_auth(),
            json={"messages": CHAT, "max_tokens": 200},
            timeout=httpx.Timeout(10.0, read=0.3),
        )
    _all_aborted(engine, 1, tools)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_gone_before_the_first_token_aborts(
    fake: Fake, tools: SimpleNamespace, route: str, stream: bool
) -> None:
    engine, srv = fake
    engine.step_delay = 60.0  # the first token would come after a minute
    field = {"messages": CHAT} if "chat" in route else {"prompt": "x"}
    body = json.dumps({**field, "max_tokens": 5, "stream": stream}).encode()
    sock = _raw_request(srv, route, body)
    try:
        assert tools.wait_until(lambda: len(engine.running) == 1, 10)  # queued, no token yet
    finally:
        sock.close()
    _all_aborted(engine, 1, tools)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_fan_out_aborts_every_member(fake: Fake, tools: SimpleNamespace, stream: bool) -> None:
    engine, srv = fake
    body = {"prompt": ["ab", "cd"], "n": 2, "max_tokens": 200, "stream": stream}
    url = srv.base_url + "/v1/completions"
    if stream:
        with httpx.stream("POST", url, headers=_auth(), json=body) as resp:
            lines = resp.iter_lines()
            _first_event(lines)
            assert tools.wait_until(lambda: len(engine.running) == 4, 5)
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, headers=_auth(), json=body, timeout=httpx.Timeout(10.0, read=0.5))
    _all_aborted(engine, 4, tools)
    base = engine.calls[0][0].rsplit("-", 1)[0]
    assert sorted(engine.aborted) == [f"{base}-{k}" for k in range(4)]


def test_body_still_uploading_never_reaches_the_engine(fake: Fake, tools: SimpleNamespace) -> None:
    """The part that arrived is a complete, valid request on its own: a server that took
    the disconnect for the end of the body would run it."""
    engine, srv = fake
    partial = json.dumps({"prompt": "x", "max_tokens": 3}).encode()
    sock = _raw_request(srv, "/v1/completions", partial, content_length=len(partial) + 500)
    sock.close()
    # The request's task ends (no reader stuck on a body that will never come) ...
    assert tools.wait_until(lambda: not srv.server.server_state.tasks, 10)
    # ... and the engine never saw it.
    assert engine.calls == [] and engine.aborted == []
    ok = httpx.post(srv.base_url + "/v1/completions", headers=_auth(), json={"prompt": "y"})
    assert ok.status_code == 200 and len(engine.calls) == 1
