"""Structured-output and tool-call API on a scripted engine, through the official client.

The engine here writes canned replies, so these tests pin down the server's side: which
constraint reaches the engine, every bad input as a 400 naming its field before anything
is queued, and tool calls parsed from model text, streamed and not, in the OpenAI shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from engine.config import EngineConfig
from engine.grammar_spec import GrammarSpec
from server.app import create_app
from server.args import ServerArgs
from tests.integration.fake_engine import FakeEngine

KEY = "fake-key"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

Fake = tuple[FakeEngine, Any]


@pytest.fixture
def fake(tools: SimpleNamespace) -> Iterator[Fake]:
    holder: dict[str, FakeEngine] = {}

    def factory(config: EngineConfig) -> FakeEngine:
        engine = FakeEngine(config, step_delay=0.0)
        engine.max_model_len = 4096  # room for the tool instructions (one token per byte)
        holder["engine"] = engine
        return engine

    args = ServerArgs(engine=EngineConfig(), api_key=KEY)
    with tools.ThreadServer(create_app(args, engine_factory=factory)) as srv:
        assert tools.wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 200)
        yield holder["engine"], srv


def client_of(srv: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0)


def post(srv: Any, route: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.post(srv.base_url + route, json=body, headers=headers, timeout=30)


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


# ---------------------------------------------------------------- tool calls


def reassemble(stream: Any) -> tuple[str | None, list[dict[str, str]], str | None]:
    """Content, tool calls and finish_reason from streamed chunks, as a client rebuilds them."""
    content = ""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for fragment in delta.tool_calls or []:
                call = calls.setdefault(fragment.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += fragment.id or ""
                if fragment.function is not None:
                    call["name"] += fragment.function.name or ""
                    call["arguments"] += fragment.function.arguments or ""
            finish = choice.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def both_ways(
    srv: Any, **kw: Any
) -> tuple[Any, tuple[str | None, list[dict[str, str]], str | None]]:
    client = client_of(srv)
    whole = client.chat.completions.create(model="fake-model", messages=USER, **kw).choices[0]
    streamed = reassemble(
        client.chat.completions.create(model="fake-model", messages=USER, stream=True, **kw)
    )
    return whole, streamed


def calls_of(choice: Any) -> list[dict[str, str]]:
    return [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in choice.message.tool_calls or []
    ]


def same_calls(a: list[dict[str, str]], b: list[dict[str, str]]) -> bool:
    strip = [{k: v for k, v in c.items() if k != "id"} for c in a]
    return strip == [{k: v for k, v in c.items() if k != "id"} for c in b]


HERMES_REPLY = (
    "Let me check that.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_auto_parses_hermes_calls_streamed_and_not(fake: Fake) -> None:
    engine, srv = fake
    engine.reply = HERMES_REPLY
    whole, (content, calls, finish) = both_ways(srv, tools=[WEATHER, TIME], max_tokens=400)
    assert whole.finish_reason == "tool_calls" == finish
    assert whole.message.content == "Let me check that." == content
    got = calls_of(whole)
    assert [c["name"] for c in got] == ["get_weather", "get_time"]
    assert json.loads(got[0]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert json.loads(got[1]["arguments"]) == {}
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in got + calls)
    assert same_calls(got, calls)
    # Auto leaves the text free: no constraint went to the engine.
    assert all(params.grammar is None for _, params in engine.calls)


@pytest.mark.parametrize(
    "reply",
    [
        "Paris is sunny today, no tool needed.",
        "I would use <tool_call> tags, but not now.",  # a marker without a JSON call
        '<tool_call>\n{"name": "unknown_tool", "arguments": {}}\n</tool_call>',
        "a < b <tool",  # ends with what could have been the start of a marker
    ],
)
def test_auto_without_a_call_is_plain_content(fake: Fake, reply: str) -> None:
    engine, srv = fake
    engine.reply = reply
    whole, (content, calls, finish) = both_ways(srv, tools=[WEATHER], max_tokens=400)
    assert whole.finish_reason == "stop" == finish
    assert whole.message.content == reply == content
    assert whole.message.tool_calls is None and calls == []


def test_cut_reply_is_length_and_never_a_call(fake: Fake) -> None:
    engine, srv = fake
    engine.reply = HERMES_REPLY
    whole, (content, calls, finish) = both_ways(srv, tools=[WEATHER, TIME], max_tokens=40)
    assert whole.finish_reason == "length" == finish
    assert whole.message.content == HERMES_REPLY[:40] == content
    assert whole.message.tool_calls is None and calls == []


def test_required_and_named_send_a_schema_and_shape_the_reply(fake: Fake) -> None:
    engine, srv = fake
    engine.reply = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    whole, (content, calls, finish) = both_ways(
        srv, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False
    )
    schema = json.loads(engine.calls[-1][1].grammar.value)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert whole.finish_reason == "tool_calls" == finish
    assert whole.message.content is None and content is None
    assert calls_of(whole)[0]["name"] == "get_weather"
    assert json.loads(calls_of(whole)[0]["arguments"]) == {"city": "Oslo"}
    assert same_calls(calls_of(whole), calls)

    engine.reply = '{"city": "Rome", "unit": "f"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole, (content, calls, finish) = both_ways(srv, tools=[WEATHER, TIME], tool_choice=named)
    assert json.loads(engine.calls[-1][1].grammar.value) == WEATHER["function"]["parameters"]
    assert whole.finish_reason == "stop" == finish  # OpenAI: a named call ends with stop
    assert calls_of(whole)[0]["name"] == "get_weather"
    assert json.loads(calls_of(whole)[0]["arguments"]) == {"city": "Rome", "unit": "f"}
    assert same_calls(calls_of(whole), calls)


def test_tool_choice_none_sends_no_tools(fake: Fake) -> None:
    engine, srv = fake
    engine.reply = HERMES_REPLY
    whole = (
        client_of(srv)
        .chat.completions.create(
            model="fake-model", messages=USER, tools=[WEATHER], tool_choice="none"
        )
        .choices[0]
    )
    assert whole.message.content == HERMES_REPLY and whole.message.tool_calls is None
    assert whole.finish_reason == "stop"


def test_tool_prompt_and_history_are_written_for_a_template_without_tools(fake: Fake) -> None:
    engine, srv = fake
    engine.reply = "It is 21 degrees."
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    reply = client_of(srv).chat.completions.create(
        model="fake-model", messages=messages, tools=[WEATHER]
    )
    assert reply.choices[0].message.content == "It is 21 degrees."
    prompt = engine.tokenizer.decode(engine.prompts[-1])
    assert "<tools>" in prompt and '"get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n21 C\n</tool_response>" in prompt


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
