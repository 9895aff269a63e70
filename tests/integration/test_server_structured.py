"""Structured outputs and forced tool calls from the real default model, via ``openai``.

Every constrained reply that ends with ``stop`` must validate against its schema
(``jsonschema`` is the independent judge); streamed replies must reassemble to the
non-streamed one of the same greedy request.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Invent a person. Reply in JSON."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def parallel(*calls: Callable[[], Any]) -> list[Any]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


def test_json_schema_validates_over_seeds(client: openai.OpenAI, model_name: str) -> None:
    def ask(seed: int) -> Any:
        return client.chat.completions.create(
            model=model_name,
            messages=ASK,
            response_format=json_schema_format(PERSON),  # type: ignore[arg-type]
            temperature=1.0,
            seed=seed,
            max_tokens=60,
            n=2,
        )

    for reply in parallel(*(lambda s=s: ask(s) for s in range(3))):
        for choice in reply.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_completions_regex_and_json_object(client: openai.OpenAI, model_name: str) -> None:
    regex, obj = parallel(
        lambda: client.completions.create(
            model=model_name,
            prompt="A phone number:",
            max_tokens=20,
            temperature=0.8,
            seed=1,
            extra_body={"regex": r"\d{3}-\d{4}"},
        ),
        lambda: client.chat.completions.create(
            model=model_name,
            messages=ASK,
            max_tokens=40,
            temperature=0,
            response_format={"type": "json_object"},
        ),
    )
    assert re.fullmatch(r"\d{3}-\d{4}", regex.choices[0].text)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.startswith("{")


def test_stream_reassembles_to_the_same_json(client: openai.OpenAI, model_name: str) -> None:
    kwargs: dict[str, Any] = dict(
        model=model_name,
        messages=ASK,
        temperature=0,
        max_tokens=60,
        extra_body={"guided_json": PERSON},
    )
    whole, chunks = parallel(
        lambda: client.chat.completions.create(**kwargs),
        lambda: list(client.chat.completions.create(stream=True, **kwargs)),
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    jsonschema.validate(json.loads(streamed), PERSON)


def _streamed_calls(chunks: list[Any]) -> tuple[list[dict[str, str]], str | None]:
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            for fragment in choice.delta.tool_calls or []:
                call = calls.setdefault(fragment.index, {"name": "", "arguments": ""})
                call["name"] += fragment.function.name or ""
                call["arguments"] += fragment.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("mode", ["required", "named"])
def test_forced_tool_calls(client: openai.OpenAI, model_name: str, mode: str) -> None:
    choice: Any = (
        "required" if mode == "required" else {"type": "function", "function": {"name": "get_time"}}
    )
    kwargs: dict[str, Any] = dict(
        model=model_name,
        messages=WEATHER_ASK,
        tools=[WEATHER, TIME],
        tool_choice=choice,
        parallel_tool_calls=False,  # one call: a short reply on a slow CPU
        temperature=0,
        max_tokens=80,
    )
    whole, chunks = parallel(
        lambda: client.chat.completions.create(**kwargs),
        lambda: list(client.chat.completions.create(stream=True, **kwargs)),
    )
    message = whole.choices[0].message
    assert len(message.tool_calls or []) == 1
    assert whole.choices[0].finish_reason == ("tool_calls" if mode == "required" else "stop")
    assert message.content is None and message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        if mode == "named":
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    streamed, finish = _streamed_calls(chunks)
    assert finish == whole.choices[0].finish_reason
    assert streamed == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls
    ]
