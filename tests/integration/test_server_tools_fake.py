"""Tool calls on a scripted engine, through the official client: parsed from the model's
text, streamed and not, in the OpenAI shape; the tool prompt and the constraint sent."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from tests.integration.fake_server import (
    TIME,
    USER,
    WEATHER,
    Fake,
    client_of,
    fake_server,
)


@pytest.fixture
def fake(tools: SimpleNamespace) -> Iterator[Fake]:
    with fake_server(tools) as served:
        yield served


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


# ---------------------------------------------------------------- arguments as they are written

LONG_CITY = "Llanfairpwllgwyngyllgogerychwyrndrobwllllantysiliogogogoch, Wales"
LONG_REPLY = (
    "Checking.\n<tool_call>\n"
    f'{{"name": "get_weather", "arguments": {{"city": "{LONG_CITY}", "unit": "c"}}}}\n'
    "</tool_call>"
)


def streamed_with_helper(srv: Any, **kw: Any) -> tuple[list[Any], Any]:
    """The events of the official client's streaming helper, and its accumulated reply."""
    client = client_of(srv)
    with client.chat.completions.stream(model="fake-model", messages=USER, **kw) as stream:
        events = list(stream)
        return events, stream.get_final_completion()


@pytest.mark.parametrize(
    "reply,kw",
    [
        (LONG_REPLY, {}),
        (
            f'[{{"name": "get_weather", "parameters": {{"city": "{LONG_CITY}"}}}}]',
            {"tool_choice": "required"},
        ),
        (
            f'{{"city": "{LONG_CITY}", "unit": "f"}}',
            {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        ),
    ],
    ids=["auto", "required", "named"],
)
def test_arguments_stream_as_they_are_written(fake: Fake, reply: str, kw: dict[str, Any]) -> None:
    engine, srv = fake
    engine.reply = reply
    whole = client_of(srv).chat.completions.create(
        model="fake-model", messages=USER, tools=[WEATHER, TIME], **kw
    )
    events, final = streamed_with_helper(srv, tools=[WEATHER, TIME], **kw)
    # The helper's accumulation of the deltas is the non-streamed message.
    assert same_calls(calls_of(final.choices[0]), calls_of(whole.choices[0]))
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason
    assert LONG_CITY in json.loads(calls_of(whole.choices[0])[0]["arguments"])["city"]
    # The id and name come first, alone; the arguments follow in many fragments.
    fragments = [
        call
        for e in events
        if e.type == "chunk"
        for choice in e.chunk.choices
        for call in choice.delta.tool_calls or []
    ]
    first = fragments[0]
    assert first.id and first.function.name == "get_weather" and not first.function.arguments
    with_text = [f for f in fragments[1:] if f.function and f.function.arguments]
    assert len(with_text) > len(LONG_CITY) // 2
    assert all(f.id is None and f.function.name is None for f in with_text)
    assert sum(e.type == "tool_calls.function.arguments.delta" for e in events) > 1


def test_a_cut_call_ends_the_stream_with_length(fake: Fake) -> None:
    """A call already streaming cannot be taken back: the stream ends with the partial call
    and finish_reason length (as OpenAI streams it); the whole reply is then content."""
    engine, srv = fake
    engine.reply = LONG_REPLY
    whole, (content, calls, finish) = both_ways(srv, tools=[WEATHER], max_tokens=80)
    assert whole.finish_reason == "length" == finish
    assert whole.message.content == LONG_REPLY[:80] and whole.message.tool_calls is None
    assert content == "Checking." and len(calls) == 1 and calls[0]["name"] == "get_weather"
    # What was written of the arguments before the cut (already canonical here).
    assert calls[0]["arguments"] == LONG_REPLY[:80].split('"arguments": ')[1]
