"""Streams whose text-only chunks take the cut template (server.text_event) are byte for
byte the streams pydantic renders for every chunk: completions and chat, n > 1, echo,
logprobs, stops and usage, on the scripted engine."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from engine.config import EngineConfig
from server import serve_chat, serve_completions
from server.app import create_app
from server.args import ServerArgs
from tests.integration.fake_engine import FakeEngine

REPLY = 'Line one,\n\t"quoted" \\ back — é€ 😀 中文\x01 end.'


class _Pydantic:
    """The template's stand-in that renders every chunk through pydantic."""

    def __init__(self, render: Callable[[str], str]) -> None:
        self.render = render
        self.calls = 0

    def __call__(self, text: str) -> str:
        self.calls += 1
        return self.render(text)


@pytest.fixture
def srv(tools: SimpleNamespace) -> Iterator[tuple[FakeEngine, Any]]:
    holder: dict[str, FakeEngine] = {}

    def factory(config: EngineConfig) -> FakeEngine:
        holder["engine"] = FakeEngine(config, step_delay=0.001)
        holder["engine"].reply = REPLY
        return holder["engine"]

    app = create_app(ServerArgs(engine=EngineConfig()), engine_factory=factory)
    with tools.ThreadServer(app) as server:
        assert tools.wait_until(lambda: httpx.get(server.base_url + "/health").status_code == 200)
        yield holder["engine"], server


def _normalized(body: str) -> str:
    """The stream with its per-request id and creation time replaced."""
    body = re.sub(r'"id":"(cmpl|chatcmpl)-[^"]+"', r'"id":"\1-X"', body)
    return re.sub(r'"created":\d+', '"created":0', body)


def _stream(base_url: str, path: str, body: dict[str, Any]) -> str:
    with httpx.stream("POST", base_url + path, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        return _normalized(r.read().decode("utf-8"))


CASES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 80}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 12}),  # ends on length
    ("/v1/completions", {"prompt": ["Hi", "Yo"], "n": 2, "max_tokens": 80}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 80, "echo": True}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 20, "logprobs": 1}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 80, "stop": ["back"]}),
    (
        "/v1/completions",
        {"prompt": "Hi", "max_tokens": 80, "stream_options": {"include_usage": True}},
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 80}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 80, "n": 3},
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 20,
            "logprobs": True,
            "top_logprobs": 1,
            "stream_options": {"include_usage": True},
        },
    ),
]


@pytest.mark.parametrize(("path", "body"), CASES)
def test_streams_equal_the_pydantic_rendering(
    srv: tuple[FakeEngine, Any], monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, Any]
) -> None:
    engine, server = srv
    body = {"model": "fake-model", **body}
    fast = _stream(server.base_url, path, body)
    engine.seen.clear()  # the same usage (no cache hit) the second time
    # Every chunk through pydantic: no chunk counts as text alone.
    for endpoint in (serve_completions.CompletionEndpoint, serve_chat.ChatEndpoint):
        monkeypatch.setattr(endpoint, "_text_only", lambda *_: False)
    slow = _stream(server.base_url, path, body)
    assert fast == slow
    assert fast.count("data: ") > 5 and fast.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize(("path", "body"), CASES[:3] + CASES[7:9])
def test_text_only_chunks_take_the_template(
    srv: tuple[FakeEngine, Any], monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, Any]
) -> None:
    _, server = srv
    made: list[_Pydantic] = []

    def pydantic_event(render: Callable[[str], str]) -> _Pydantic:
        made.append(_Pydantic(render))
        return made[-1]

    monkeypatch.setattr(serve_completions, "TextEvent", pydantic_event)
    monkeypatch.setattr(serve_chat, "TextEvent", pydantic_event)
    events = _stream(server.base_url, path, {"model": "fake-model", **body}).count("data: ")
    # All but each choice's first and last chunks, the usage and [DONE].
    choices = body.get("n", 1) * (
        len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    )
    assert sum(m.calls for m in made) >= events - 3 * choices - 2 > 0
