"""The server with --engine-process, through the official OpenAI client: completions and
chat, streamed and not, answer as the engine in the server's own process does, /health
and /metrics read the child's engine, and the child ends with the server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from engine import Engine, EngineConfig, SamplingParams
from server.app import create_app
from server.args import ServerArgs, parse_args


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path, tools: SimpleNamespace) -> Iterator[SimpleNamespace]:
    config = EngineConfig(
        model=str(tiny_llama_dir), device="cpu", kv_cache_tokens=4096, engine_process=True
    )
    app = create_app(ServerArgs(engine=config))
    with tools.ThreadServer(app) as server:
        assert tools.wait_until(
            lambda: httpx.get(server.base_url + "/health").status_code == 200, timeout=120
        )
        engine = app.state.hiserve.engine.engine  # the EngineProcess
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        yield SimpleNamespace(client=client, url=server.base_url, process=engine._process)
    assert not engine._process.is_alive()  # the server's shutdown ended it


def test_the_flag_sets_the_config() -> None:
    assert parse_args(["--engine-process"]).engine.engine_process is True
    assert parse_args([]).engine.engine_process is False


def test_completions_match_the_engine_in_process(served: Any, tiny_llama_dir: Path) -> None:
    client = served.client
    create = dict(
        model=client.models.list().data[0].id,
        prompt="Once upon a time",
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    plain = client.completions.create(**create)  # type: ignore[call-overload]
    chunks = list(client.completions.create(stream=True, **create))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert plain.usage is not None and plain.usage.completion_tokens == 10
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", kv_cache_tokens=4096))
    try:
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        want = engine.generate(["Once upon a time"], params)[0]
    finally:
        engine.close()
    assert plain.choices[0].text == want.text


def test_chat_stream_and_n(served: Any) -> None:
    client = served.client
    create = dict(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    plain = client.chat.completions.create(n=2, **create)  # type: ignore[call-overload]
    assert len(plain.choices) == 2
    assert plain.choices[0].message.content == plain.choices[1].message.content  # greedy
    stream = list(client.chat.completions.create(stream=True, **create))  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == plain.choices[0].message.content


def test_health_and_metrics_read_the_child(served: Any, tools: SimpleNamespace) -> None:
    health = httpx.get(served.url + "/health").json()
    assert health["status"] == "ok" and health["kv_total_tokens"] == 4096
    before = tools.metric_value(
        httpx.get(served.url + "/metrics").text, "hiserve:generation_tokens_total"
    )
    served.client.completions.create(
        model=served.client.models.list().data[0].id,
        prompt="Hi",
        max_tokens=5,
        extra_body={"ignore_eos": True},
    )
    after = tools.metric_value(
        httpx.get(served.url + "/metrics").text, "hiserve:generation_tokens_total"
    )
    assert after - before == 5  # a request's end sends the stats with its output
    assert served.process.is_alive()
