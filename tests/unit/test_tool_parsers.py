"""Tool-call parsers on canned model replies, whole and fed in token-sized chunks."""

from __future__ import annotations

import json
import random

import pytest

from server.protocol import DeltaToolCall
from server.tools.definitions import ToolDef, ToolPlan
from server.tools.parsers import (
    HermesParser,
    Llama3JsonParser,
    ParsedCall,
    ToolCallParser,
    choose_parser,
)
from server.tools.response import finish_tools
from server.tools.stream import ToolStream

TOOLS = [
    ToolDef("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}}}),
    ToolDef("get_time", "", {"type": "object"}),
]
AUTO = ToolPlan(TOOLS, "auto")

CASES: list[tuple[ToolCallParser, str, str | None, list[tuple[str, dict[str, object]]]]] = [
    (
        HermesParser(),
        'Sure.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>',
        "Sure.",
        [("get_weather", {"city": "Zürich"}), ("get_time", {})],
    ),
    (
        HermesParser(),
        '<tool_call>\n{"name": "get_time", "arguments": {}}',  # unclosed at the end
        None,
        [("get_time", {})],
    ),
    (
        HermesParser(),
        "x <tool_call> not json </tool_call>",
        "x <tool_call> not json </tool_call>",
        [],
    ),
    (HermesParser(), "1 < 2 and <tool", "1 < 2 and <tool", []),
    (
        Llama3JsonParser(),
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "parameters": {}}',
        None,
        [("get_weather", {"city": "Oslo"}), ("get_time", {})],
    ),
    (
        Llama3JsonParser(),
        '  {"name": "get_time", "arguments": {}}',
        None,
        [("get_time", {})],
    ),
    (Llama3JsonParser(), "It is noon.", "It is noon.", []),
    (
        Llama3JsonParser(),
        '{"name": "other", "parameters": {}}',
        '{"name": "other", "parameters": {}}',
        [],
    ),
    (Llama3JsonParser(), '{"name": "get_time", "param', '{"name": "get_time", "param', []),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_parse_and_streamed_reassembly_agree(case: int) -> None:
    parser, text, content, calls = CASES[case]
    outcome = finish_tools(AUTO, parser, text, "stop")
    assert outcome.content == content
    assert [(c.name, json.loads(c.arguments)) for c in outcome.calls] == calls
    assert outcome.finish_reason == ("tool_calls" if calls else "stop")
    rng = random.Random(case)
    for _ in range(20):
        stream = ToolStream(AUTO, parser)
        streamed = ""
        fragments = []
        pos = 0
        while pos < len(text):
            step = rng.randint(1, 6)
            piece, deltas = stream.feed(text[pos : pos + step])
            streamed += piece
            fragments += deltas
            pos += step
        rest, final_deltas, final = stream.finish("stop")
        assert (streamed + rest or None) == content
        assert final.calls == outcome.calls
        assert reassembled(fragments + final_deltas) == outcome.calls


def reassembled(fragments: list[list[DeltaToolCall]]) -> list[ParsedCall]:
    """The calls a client rebuilds from streamed fragments (one id and name per index)."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for (delta,) in fragments:
        assert delta.function is not None
        if delta.id is not None:
            assert delta.index not in names and delta.function.name is not None
            names[delta.index] = delta.function.name
        arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
    assert sorted(names) == list(range(len(names)))
    return [ParsedCall(names[i], arguments[i]) for i in sorted(names)]


def test_auto_choice_follows_the_template() -> None:
    assert isinstance(choose_parser("auto", None), HermesParser)
    assert isinstance(choose_parser("auto", "{{ '<|python_tag|>' }} tools"), Llama3JsonParser)
    assert isinstance(choose_parser("auto", "{% if tools %}<tool_call>{% endif %}"), HermesParser)
    assert isinstance(choose_parser("llama3_json", None), Llama3JsonParser)
    assert isinstance(choose_parser("qwen", None), HermesParser)


DEEP = 5000  # past json's recursion limit (about 1,400 levels here)


def _deep_object(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (HermesParser(), f'<tool_call>{{"name": "get_time", "arguments": {_deep_object(DEEP)}}}'),
        (HermesParser(), '<tool_call>{"name": "get_time", "arguments": "' + "[" * DEEP + '"}'),
        (Llama3JsonParser(), f'{{"name": "get_time", "parameters": {_deep_object(DEEP)}}}'),
    ],
    ids=["hermes", "hermes-string-arguments", "llama3_json"],
)
def test_too_deeply_nested_calls_are_plain_text(parser: ToolCallParser, text: str) -> None:
    """A forced, deeply nested call is no call (the text is the content), never an
    uncaught RecursionError (a 500, issue 25 item 13)."""
    result = parser.parse(text, ["get_time"])
    assert result.calls == []
    assert result.content == text
    outcome = finish_tools(AUTO, parser, text, "stop")
    assert (outcome.calls, outcome.content, outcome.finish_reason) == ([], text, "stop")


def test_too_deeply_nested_required_and_named_calls_stay_text() -> None:
    deep = "[" * DEEP + "]" * DEEP
    required = finish_tools(ToolPlan(TOOLS, "required"), HermesParser(), deep, "stop")
    assert (required.calls, required.content) == ([], deep)
    named = finish_tools(ToolPlan(TOOLS, "named", "get_time"), HermesParser(), deep, "stop")
    assert named.calls[0].arguments == deep  # the raw text, as for any unparsable arguments
