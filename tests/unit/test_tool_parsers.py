"""Tool-call parsers on canned model replies, whole and fed in token-sized chunks."""

from __future__ import annotations

import json
import random

import pytest

from server.tools.definitions import ToolDef, ToolPlan
from server.tools.parsers import HermesParser, Llama3JsonParser, ToolCallParser, choose_parser
from server.tools.response import ToolStream, finish_tools

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
        pos = 0
        while pos < len(text):
            step = rng.randint(1, 6)
            streamed += stream.feed(text[pos : pos + step])
            pos += step
        rest, final = stream.finish("stop")
        assert (streamed + rest or None) == content
        assert final.calls == outcome.calls


def test_auto_choice_follows_the_template() -> None:
    assert isinstance(choose_parser("auto", None), HermesParser)
    assert isinstance(choose_parser("auto", "{{ '<|python_tag|>' }} tools"), Llama3JsonParser)
    assert isinstance(choose_parser("auto", "{% if tools %}<tool_call>{% endif %}"), HermesParser)
    assert isinstance(choose_parser("llama3_json", None), Llama3JsonParser)
    assert isinstance(choose_parser("qwen", None), HermesParser)
