"""--cached-tokens-scope over HTTP: on a shared cache, a caller probing another caller's
prompt is told 0 cached tokens under ``key`` (the scripted engine reports a hit on any
prompt seen before, whoever sent it)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from engine.config import EngineConfig
from server.app import create_app
from server.args import ServerArgs, parse_args
from tests.integration.fake_engine import FakeEngine

PROMPT = list(range(100, 180))


@pytest.fixture
def serve(tools: SimpleNamespace) -> Iterator[Any]:
    servers: list[Any] = []

    def start(scope: str) -> Any:
        args = ServerArgs(engine=EngineConfig(), cached_tokens_scope=scope)
        srv = tools.ThreadServer(create_app(args, engine_factory=FakeEngine))
        servers.append(srv.__enter__())
        health = srv.base_url + "/health"
        assert tools.wait_until(lambda: httpx.get(health).status_code == 200)
        return srv

    yield start
    for srv in servers:
        srv.__exit__(None, None, None)


def details(srv: Any, token: str, stream: bool = False) -> dict[str, Any]:
    """``usage.prompt_tokens_details`` of one completion of PROMPT sent as ``token``."""
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 2, "stream": stream}
    headers = {"Authorization": f"Bearer {token}"}
    if not stream:
        answer = httpx.post(srv.base_url + "/v1/completions", json=body, headers=headers)
        assert answer.status_code == 200, answer.text
        found: dict[str, Any] = answer.json()["usage"]["prompt_tokens_details"]
        return found
    body["stream_options"] = {"include_usage": True}
    with httpx.stream(
        "POST", srv.base_url + "/v1/completions", json=body, headers=headers
    ) as answer:
        lines = [line for line in answer.iter_lines() if '"usage":{' in line]
    found = json.loads(lines[-1].removeprefix("data: "))["usage"]["prompt_tokens_details"]
    return found


def cached(srv: Any, token: str, stream: bool = False) -> int:
    return int(details(srv, token, stream)["cached_tokens"])


def test_default_reports_every_hit(serve: Any) -> None:
    srv = serve("all")
    assert cached(srv, "alice") == 0
    assert cached(srv, "mallory") == len(PROMPT) - 1  # Alice's prompt, revealed


def test_key_scope_hides_hits_on_prefixes_another_key_sent(serve: Any) -> None:
    srv = serve("key")
    assert cached(srv, "alice") == 0
    assert cached(srv, "mallory") == 0  # a hit on Alice's prompt, not reported
    assert cached(srv, "mallory", stream=True) == len(PROMPT) - 1  # her own now
    assert cached(srv, "alice") == len(PROMPT) - 1


def test_none_scope_reports_nothing(serve: Any) -> None:
    srv = serve("none")
    assert cached(srv, "alice") == 0 and cached(srv, "alice") == 0


def test_the_flag_is_parsed_and_checked() -> None:
    assert parse_args(["--cached-tokens-scope", "key"], {}).cached_tokens_scope == "key"
    assert parse_args([], {"HISERVE_CACHED_TOKENS_SCOPE": "none"}).cached_tokens_scope == "none"
    with pytest.raises(SystemExit):
        parse_args(["--cached-tokens-scope", "mine"], {})


@pytest.mark.parametrize("stream", [False, True])
def test_miss_reasons_are_reported_only_with_every_hit(serve: Any, stream: bool) -> None:
    """Evicted vs never seen tells whether someone sent a prefix: shown under ``all``
    (where the hits are shown too), left out where the scope hides others' prompts."""
    srv = serve("all")
    first = details(srv, "alice", stream)
    assert first["cache_miss_reasons"] == {
        "never_seen": len(PROMPT) - 1, "evicted": 0, "below_page": 1, "not_loaded": 0,
        "storage_timeout": 0, "not_routed": 0,
    }  # fmt: skip
    again = details(srv, "mallory", stream)
    assert again["cached_tokens"] + sum(again["cache_miss_reasons"].values()) == len(PROMPT)
    for scope in ("key", "none"):
        hidden = serve(scope)
        for token in ("alice", "alice", "mallory"):
            assert "cache_miss_reasons" not in details(hidden, token, stream)
