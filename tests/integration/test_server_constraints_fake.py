"""Structured outputs on a scripted engine, through the official client and raw HTTP.

The engine here writes canned replies, so these tests pin down the server's side: which
constraint reaches the engine, every bad input as a 400 naming its field before anything
is queued (tool calls: test_server_tools_fake.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from engine.grammar_spec import GrammarSpec
from tests.integration.fake_server import (
    KEY,
    SCHEMA,
    USER,
    WEATHER,
    Fake,
    fake_server,
    post,
)


@pytest.fixture
def fake(tools: SimpleNamespace) -> Iterator[Fake]:
    with fake_server(tools) as served:
        yield served


# ---------------------------------------------------------------- which constraint


CONSTRAINTS: list[tuple[str, dict[str, Any], GrammarSpec]] = [
    (
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA},
            }
        },
        GrammarSpec.json_schema(SCHEMA, "-"),
    ),
    ("chat", {"response_format": {"type": "json_object"}}, GrammarSpec.json_object("-")),
    ("cmpl", {"response_format": {"type": "json_object"}}, GrammarSpec.json_object("-")),
    ("cmpl", {"structured_outputs": {"json": SCHEMA}}, GrammarSpec.json_schema(SCHEMA, "-")),
    ("chat", {"structured_outputs": {"regex": "a+"}}, GrammarSpec.regex("a+", "-")),
    ("cmpl", {"structured_outputs": {"choice": ["x", "y"]}}, GrammarSpec.choice(["x", "y"], "-")),
    (
        "chat",
        {"structured_outputs": {"grammar": 'root ::= "q"'}},
        GrammarSpec.ebnf('root ::= "q"', "-"),
    ),
    ("cmpl", {"guided_json": json.dumps(SCHEMA)}, GrammarSpec.json_schema(SCHEMA, "-")),
    ("chat", {"guided_regex": "b+"}, GrammarSpec.regex("b+", "-")),
    ("cmpl", {"guided_choice": ["x"]}, GrammarSpec.choice(["x"], "-")),
    ("chat", {"guided_grammar": 'root ::= "q"'}, GrammarSpec.ebnf('root ::= "q"', "-")),
    ("cmpl", {"regex": "c+"}, GrammarSpec.regex("c+", "-")),
    ("chat", {"ebnf": 'root ::= "q"'}, GrammarSpec.ebnf('root ::= "q"', "-")),
    ("cmpl", {"json_schema": json.dumps(SCHEMA)}, GrammarSpec.json_schema(SCHEMA, "-")),
    ("chat", {"response_format": {"type": "text"}}, None),  # type: ignore[list-item]
]


@pytest.mark.parametrize("route,extra,expected", CONSTRAINTS)
def test_constraint_reaches_every_choice(
    fake: Fake, route: str, extra: dict[str, Any], expected: GrammarSpec | None
) -> None:
    engine, srv = fake
    body: dict[str, Any] = {"max_tokens": 2, "n": 2, **extra}
    if route == "chat":
        resp = post(srv, "/v1/chat/completions", {"messages": USER, **body})
    else:
        resp = post(srv, "/v1/completions", {"prompt": "x", **body})
    assert resp.status_code == 200, resp.text
    assert [params.grammar for _, params in engine.calls] == [expected, expected]


# ---------------------------------------------------------------- bad input

BAD: list[tuple[str, dict[str, Any], str]] = [
    ("cmpl", {"regex": "(a", "guided_json": SCHEMA}, "regex"),
    ("chat", {"response_format": {"type": "json_object"}, "ebnf": 'root ::= "a"'}, "ebnf"),
    ("chat", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("cmpl", {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ("cmpl", {"regex": "(a"}, "regex"),
    ("cmpl", {"regex": "a\x00"}, "regex"),
    ("cmpl", {"guided_grammar": "root ::= undefined"}, "guided_grammar"),
    ("cmpl", {"ebnf": "not a grammar"}, "ebnf"),
    ("cmpl", {"guided_choice": []}, "guided_choice"),
    ("cmpl", {"guided_choice": "x"}, "guided_choice"),
    ("cmpl", {"guided_json": "{not json"}, "guided_json"),
    ("cmpl", {"guided_json": {"type": "nosuchtype"}}, "guided_json"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "bad name!", "schema": {}},
            }
        },
        "response_format.json_schema.name",
    ),
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    # Schema features the engine would silently ignore, or unroll at great cost.
    ("cmpl", {"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json"),
    ("cmpl", {"guided_json": {"type": "integer", "multipleOf": 3}}, "guided_json"),
    ("cmpl", {"guided_json": {"type": "string", "format": "credit-card"}}, "guided_json"),
    ("cmpl", {"guided_json": {"type": "string", "maxLength": 100000}}, "guided_json"),
    ("cmpl", {"guided_json": {"type": "string", "pattern": "a+", "maxLength": 3}}, "guided_json"),
    ("cmpl", {"guided_json": {"type": "object", "description": "x" * 70000}}, "guided_json"),
    # Tools
    ("chat", {"tools": [{"type": "retrieval"}]}, "tools.0"),
    (
        "chat",
        {"tools": [{"type": "function", "function": {"name": "a b"}}]},
        "tools.0.function.name",
    ),
    ("chat", {"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    (
        "chat",
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
            ]
        },
        "tools.0.function.parameters",
    ),
    (
        "chat",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "multipleOf": 2}},
                }
            ]
        },
        "tools.0.function.parameters",
    ),
    ("chat", {"tools": [WEATHER] * 0, "tool_choice": "required"}, "tool_choice"),
    ("chat", {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    (
        "chat",
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    (
        "chat",
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
    ),
]


@pytest.mark.parametrize("route,extra,param", BAD)
def test_bad_input_is_a_400_before_queueing(
    fake: Fake, route: str, extra: dict[str, Any], param: str
) -> None:
    engine, srv = fake
    if route == "chat":
        resp = post(srv, "/v1/chat/completions", {"messages": USER, **extra})
    else:
        resp = post(srv, "/v1/completions", {"prompt": "x", **extra})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert error["message"]
    assert engine.calls == []


# ---------------------------------------------------------------- abuse (issue 25 item 1)


def test_a_slow_constraint_check_does_not_block_the_server(
    fake: Fake, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grammar engine's parse of a constraint runs off the event loop: while one takes
    3 s, /health answers at once."""
    import threading
    import time

    import server.constraints as constraints

    real = constraints.check_spec
    started = threading.Event()

    def slow(spec: GrammarSpec) -> None:
        started.set()
        time.sleep(3.0)
        real(spec)

    monkeypatch.setattr(constraints, "check_spec", slow)
    _, srv = fake
    body = {"prompt": "x", "max_tokens": 2, "guided_regex": "[a-z]+"}
    with ThreadPoolExecutor(1) as pool:
        slow_reply = pool.submit(post, srv, "/v1/completions", body)
        assert started.wait(10)
        t0 = time.perf_counter()
        health = httpx.get(srv.base_url + "/health", timeout=10)
        took = time.perf_counter() - t0
        assert slow_reply.result(timeout=30).status_code == 200
    assert health.status_code == 200
    assert took < 1.0, f"/health took {took:.2f} s behind a constraint check"


DEEP = '{"type":"array","items":' * 950 + '{"type":"integer"}' + "}" * 950  # 35 KB


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("/v1/completions", '{"prompt": "x", "guided_json": %s}', "guided_json"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi"}], "response_format": '
            '{"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}}',
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
            '"function": {"name": "f", "parameters": {"type": "object", "properties": '
            '{"a": %s}}}}]}',
            "tools.0.function.parameters",
        ),
    ],
    ids=["guided_json", "response_format", "tools"],
)
def test_deeply_nested_schemas_are_refused_at_once(
    fake: Fake, route: str, body: str, param: str
) -> None:
    """950 nested arrays (35 KB) froze a server for 38 s (issue 25 item 1): now a 400."""
    engine, srv = fake
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    content = (body % DEEP).encode()
    resp = httpx.post(srv.base_url + route, content=content, headers=headers, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert "nested more than 64 levels" in resp.json()["error"]["message"]
    assert engine.calls == []


def test_constrained_choices_are_bounded(fake: Fake) -> None:
    """Issue 25 item 2: every copy of a constrained request runs its own matcher."""
    engine, srv = fake
    body = {"prompt": ["x", "y", "z"], "n": 3, "max_tokens": 2, "guided_regex": "[a-z]+"}
    resp = post(srv, "/v1/completions", body)  # 9 choices
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "n"
    assert "--max-grammar-choices" in resp.json()["error"]["message"]
    assert engine.calls == []
    assert post(srv, "/v1/completions", {**body, "prompt": ["x", "y"], "n": 4}).status_code == 200
    assert post(srv, "/v1/completions", {**body, "guided_regex": None}).status_code == 200
