"""--stream-interval through the OpenAI client, on the real engine: a streamed completion
comes in chunks of the first token and then N tokens each, and joins into the text a
request that does not stream gets (which the engine sends only at its first token and
at the end)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from engine.config import EngineConfig
from server.app import create_app
from server.args import ServerArgs


@pytest.fixture(scope="module")
def client(tiny_llama_dir: Path, tools: SimpleNamespace) -> Iterator[openai.OpenAI]:
    config = EngineConfig(
        model=str(tiny_llama_dir), device="cpu", kv_cache_tokens=4096, stream_interval=4
    )
    with tools.ThreadServer(create_app(ServerArgs(engine=config))) as server:
        assert tools.wait_until(
            lambda: httpx.get(server.base_url + "/health").status_code == 200, timeout=120
        )
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")


def test_completion_chunks_carry_interval_tokens(client: openai.OpenAI) -> None:
    create = dict(
        model=client.models.list().data[0].id,
        prompt="Once upon a time",
        max_tokens=14,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    plain = client.completions.create(**create)  # type: ignore[call-overload]
    chunks = [c for c in client.completions.create(stream=True, **create) if c.choices]  # type: ignore[call-overload]
    tokens = [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs]
    assert tokens == [1, 4, 4, 4, 1]
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert plain.choices[0].logprobs.tokens == [
        t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens
    ]
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason == "length"


def test_chat_stream_joins_into_the_plain_answer(client: openai.OpenAI) -> None:
    create = dict(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=11,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    plain = client.chat.completions.create(**create)  # type: ignore[call-overload]
    stream = list(client.chat.completions.create(stream=True, **create))  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == plain.choices[0].message.content
    assert plain.usage is not None and plain.usage.completion_tokens == 11
