"""Output-size limits (issue 25 item 12) on a scripted engine: logprob entries per request
and stop-string length are refused with a 400 naming the field, before anything is queued."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from engine.config import EngineConfig
from server.app import create_app
from server.args import ServerArgs
from tests.integration.fake_engine import FakeEngine

KEY = "limits-key"
USER = [{"role": "user", "content": "hi"}]
ENTRIES = 1000


@pytest.fixture(scope="module")
def served(tools: SimpleNamespace) -> Iterator[tuple[FakeEngine, Any]]:
    holder: dict[str, FakeEngine] = {}

    def factory(config: EngineConfig) -> FakeEngine:
        holder["engine"] = FakeEngine(config, step_delay=0.0)
        return holder["engine"]

    args = ServerArgs(engine=EngineConfig(max_logprob_entries=ENTRIES), api_key=KEY)
    with tools.ThreadServer(create_app(args, engine_factory=factory)) as srv:
        assert tools.wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 200)
        yield holder["engine"], srv


def post(srv: Any, route: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.post(srv.base_url + route, json=body, headers=headers, timeout=30)


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        # 4 x 100 x (1 + 2) = 1200 entries
        ("/v1/completions", {"prompt": "x", "n": 4, "max_tokens": 100, "logprobs": 2}, "logprobs"),
        # 2 prompts x 2 x 100 x 3 = 1200
        (
            "/v1/completions",
            {"prompt": ["x", "y"], "n": 2, "max_tokens": 100, "logprobs": 2},
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "n": 4, "max_tokens": 100, "logprobs": True, "top_logprobs": 2},
            "top_logprobs",
        ),
    ],
)
def test_logprob_entries_over_the_budget_are_refused(
    served: tuple[FakeEngine, Any], route: str, body: dict[str, Any], param: str
) -> None:
    engine, srv = served
    before = len(engine.calls)
    resp = post(srv, route, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param
    assert "1200" in error["message"] and "--max-logprob-entries" in error["message"]
    assert len(engine.calls) == before  # nothing was queued


def test_logprob_entries_within_the_budget_are_served(served: tuple[FakeEngine, Any]) -> None:
    _, srv = served
    # 3 x 100 x 3 = 900 entries, and without logprobs any size is fine
    ok = post(srv, "/v1/completions", {"prompt": "x", "n": 3, "max_tokens": 100, "logprobs": 2})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"][2]["logprobs"]["tokens"]) == 100
    free = post(srv, "/v1/completions", {"prompt": "x", "n": 8, "max_tokens": 200})
    assert free.status_code == 200, free.text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_long_stop_strings_are_refused(served: tuple[FakeEngine, Any], route: str) -> None:
    _, srv = served
    body: dict[str, Any] = {"max_tokens": 4}
    body.update({"prompt": "x"} if route == "/v1/completions" else {"messages": USER})
    resp = post(srv, route, {**body, "stop": ["a" * 513]})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "stop"
    assert "--max-stop-chars" in resp.json()["error"]["message"]
    assert post(srv, route, {**body, "stop": ["z" * 512]}).status_code == 200
