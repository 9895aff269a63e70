"""Request schemas accept what OpenAI clients send; responses parse with the openai types."""

from __future__ import annotations

import json
import math

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    UsageInfo,
)
from server.protocol import (
    ChatCompletionChunk as OurChunk,
)
from server.sse import SSE_DONE, sse_event


@pytest.mark.parametrize("prompt", ["hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_completion_prompt_shapes(prompt: object) -> None:
    req = CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    assert req.prompt == prompt
    assert req.n == 1 and req.stream is False


@pytest.mark.parametrize(
    "body,field",
    [
        ({"prompt": ["a", 1]}, "prompt"),
        ({"prompt": [1.5]}, "prompt"),
        ({"prompt": [True]}, "prompt"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "temperature": math.nan}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "stop": [1]}, "stop"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({}, "prompt"),
    ],
)
def test_completion_rejects_bad_fields(body: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(body)
    assert info.value.errors()[0]["loc"][0] == field


def test_unknown_fields_are_ignored() -> None:
    req = CompletionRequest.model_validate({"prompt": "x", "service_tier": "auto"})
    assert not hasattr(req, "service_tier")


def test_chat_messages() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
            "logprobs": True,
            "top_logprobs": 2,
            "max_completion_tokens": 5,
        }
    )
    assert req.messages[1].content[0].text == "hi"  # type: ignore[index,union-attr]
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": []})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "robot", "content": "x"}]})


def test_usage_always_has_cached_tokens() -> None:
    dumped = UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5).model_dump()
    assert dumped["prompt_tokens_details"]["cached_tokens"] == 0
    assert dumped["prompt_tokens_details"]["cached_tokens_device"] == 0


def _usage() -> UsageInfo:
    return UsageInfo(
        prompt_tokens=4,
        completion_tokens=2,
        total_tokens=6,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=3, cached_tokens_device=2, cached_tokens_host=1
        ),
    )


def test_completion_response_parses_with_openai_types() -> None:
    ours = CompletionResponse(
        id="cmpl-1",
        model="m",
        usage=_usage(),
        choices=[
            CompletionChoice(
                index=0,
                text="ab",
                finish_reason="length",
                logprobs=CompletionLogprobs(
                    tokens=["a", "b"],
                    token_logprobs=[-0.1, -0.2],
                    top_logprobs=[{"a": -0.1}, {"b": -0.2}],
                    text_offset=[0, 1],
                ),
            )
        ],
    )
    theirs = Completion.model_validate(json.loads(ours.model_dump_json()))
    assert theirs.choices[0].text == "ab"
    assert theirs.choices[0].logprobs is not None
    assert theirs.choices[0].logprobs.text_offset == [0, 1]
    assert theirs.usage is not None and theirs.usage.prompt_tokens_details is not None
    assert theirs.usage.prompt_tokens_details.cached_tokens == 3


def test_chat_response_and_chunk_parse_with_openai_types() -> None:
    logprobs = ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token="a",
                logprob=-0.5,
                bytes=[97],
                top_logprobs=[ChatTopLogprob(token="a", logprob=-0.5, bytes=[97])],
            )
        ]
    )
    ours = ChatCompletionResponse(
        id="chatcmpl-1",
        model="m",
        usage=_usage(),
        choices=[
            ChatChoice(
                index=0,
                message=ChatResponseMessage(content="a"),
                logprobs=logprobs,
                finish_reason="stop",
            )
        ],
    )
    theirs = ChatCompletion.model_validate(json.loads(ours.model_dump_json()))
    assert theirs.choices[0].message.content == "a"
    assert theirs.choices[0].logprobs is not None
    assert theirs.choices[0].logprobs.content is not None
    assert theirs.choices[0].logprobs.content[0].top_logprobs[0].token == "a"
    chunk = OurChunk(
        id="c",
        created=1,
        model="m",
        choices=[ChatStreamChoice(index=0, delta=DeltaMessage(content="x"))],
    )
    event = sse_event(chunk)
    assert event.startswith("data: ") and event.endswith("\n\n") and "\n" not in event[:-2]
    parsed = ChatCompletionChunk.model_validate(json.loads(event[len("data: ") :]))
    assert parsed.choices[0].delta.content == "x"
    assert SSE_DONE == "data: [DONE]\n\n"


def test_sse_event_escapes_newlines() -> None:
    event = sse_event({"text": "a\nb\n\nc"})
    assert event.count("\n") == 2
    assert json.loads(event[len("data: ") :])["text"] == "a\nb\n\nc"
