"""Load and lifecycle on the real server: disconnects free KV, 64 concurrent streams, SIGTERM.

KV usage is read from the server's own ``/metrics`` (``hiserve:kv_used_tokens``: KV owned
by running requests), so a leak shows up whatever the engine's internals are.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

LONG = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0}


def _kv_state(http: httpx.Client, tools: Any) -> tuple[float, float, float]:
    text = http.get("/metrics").text
    return (
        tools.metric_value(text, "hiserve:kv_used_tokens", 'tier="device"'),
        tools.metric_value(text, "hiserve:num_running_requests"),
        tools.metric_value(text, "hiserve:generation_tokens_total"),
    )


def _idle(http: httpx.Client, tools: Any, baseline: float) -> bool:
    used, running, _ = _kv_state(http, tools)
    return used == baseline and running == 0


def _data_events(lines: Iterator[str], count: int) -> list[dict[str, Any]]:
    """The next ``count`` ``data: {...}`` events of an SSE stream, parsed."""
    events: list[dict[str, Any]] = []
    for line in lines:
        if line.startswith("data: {"):
            events.append(json.loads(line[len("data: ") :]))
            if len(events) == count:
                break
    return events


def test_stream_closed_early_frees_kv(
    server: Any, http: httpx.Client, model_name: str, tools: Any
) -> None:
    assert tools.wait_until(lambda: _kv_state(http, tools)[1] == 0, timeout=30)
    baseline, _, generated_before = _kv_state(http, tools)
    body = {"model": model_name, "prompt": "Count slowly: one, two,", "stream": True, **LONG}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        # NOTE: the line iterator must stay referenced until the block ends. A dropped one
        # (``for line in resp.iter_lines(): ... break``) is finalized at once, and that
        # closes httpx's connection: the server then rightly sees the client go away and
        # aborts the request before the KV gauge below is read.
        lines = resp.iter_lines()
        first = _data_events(lines, 3)
        assert len(first) == 3
        # The request is running and owns KV right now (the gauge is published by the
        # engine loop after each step, so give it a moment).
        owns_kv = tools.wait_until(lambda: _kv_state(http, tools)[0] > baseline, timeout=10)
        assert owns_kv, (baseline, server.log_text()[-2500:])
        # ... and the stream is still live: the next event is an ordinary token chunk.
        more = _data_events(lines, 1)
        assert len(more) == 1, "the stream ended while the client was holding it"
        assert more[0]["id"] == first[0]["id"]
        assert more[0]["choices"][0]["finish_reason"] is None
    # Closing the stream aborted the request and gave its KV back.
    assert tools.wait_until(lambda: _idle(http, tools, baseline), timeout=10)
    generated = _kv_state(http, tools)[2] - generated_before
    assert 4 <= generated < 1000  # aborted, not run to the end


def test_plain_request_abandoned_frees_kv(
    server: Any, http: httpx.Client, model_name: str, tools: Any
) -> None:
    baseline, _, generated_before = _kv_state(http, tools)
    body = {"model": model_name, "prompt": "Tell me a very long story.", **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.base_url + "/v1/completions",
            json=body,
            headers=server.headers(),
            timeout=httpx.Timeout(30.0, read=1.5),
        )
    assert tools.wait_until(lambda: _idle(http, tools, baseline), timeout=10)
    assert _kv_state(http, tools)[2] - generated_before < 1000


def test_64_concurrent_streams(
    async_client: openai.AsyncOpenAI, model_name: str, http: httpx.Client, tools: Any
) -> None:
    async def one(i: int) -> tuple[str, str | None, int]:
        stream = await async_client.completions.create(
            model=model_name,
            prompt=f"Fact number {i} about the ocean:",
            max_tokens=8,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, reason, usage = "", None, 0
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                reason = choice.finish_reason or reason
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return text, reason, usage

    async def run_all() -> list[tuple[str, str | None, int]]:
        return await asyncio.gather(*(one(i) for i in range(64)))

    started = time.monotonic()
    results = asyncio.run(run_all())
    elapsed = time.monotonic() - started
    assert len(results) == 64
    for _text, reason, usage in results:
        assert reason in ("stop", "length")
        assert 1 <= usage <= 8
    print(f"64 concurrent streams x 8 tokens: {elapsed:.1f} s")
    assert tools.wait_until(lambda: _idle(http, tools, 0.0), timeout=10)


def test_sigterm_drains_in_flight_then_exits_0(tools: Any, tmp_path: Path) -> None:
    proc = tools.ServerProcess(
        tmp_path / "server.log", extra_args=["--shutdown-grace", "60"], api_key=None
    )
    try:
        proc.wait_ready()
        events: list[dict[str, Any]] = []
        first = threading.Event()
        done = threading.Event()

        def stream() -> None:
            body = {
                "prompt": "Once upon a time",
                "stream": True,
                "max_tokens": 32,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            }
            with httpx.stream(
                "POST", proc.base_url + "/v1/completions", json=body, timeout=120
            ) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[len("data: ") :]))
                        first.set()
                    elif line == "data: [DONE]":
                        done.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60)
        assert not done.is_set()
        proc.terminate()  # SIGTERM while the stream is in flight
        # No longer accepting new connections (the stream in flight is drained below).
        assert tools.wait_until(lambda: tools.refuses_connections(proc.base_url), timeout=30)
        reader.join(120)
        assert done.is_set()
        assert events[-1]["usage"]["completion_tokens"] == 32  # drained, not cut
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == ("length")
        assert proc.proc.wait(60) == 0
    finally:
        code = proc.stop()
    assert code == 0
    assert "draining" in proc.log_text()


def test_unloadable_model_exits_1(tools: Any, tmp_path: Path) -> None:
    proc = tools.ServerProcess(
        tmp_path / "server.log", extra_args=["--model", "/nonexistent/model-dir"], api_key=None
    )
    try:
        code = proc.proc.wait(120)
    finally:
        proc.stop()
    assert code == 1
    assert "cannot start the engine" in proc.log_text()
    assert "/nonexistent/model-dir" in proc.log_text()


def test_the_server_freezes_start_ups_objects_once_ready(server: Any) -> None:
    # engine/heap.py: a full collection no longer walks start-up's objects while serving.
    frozen = [line for line in server.log_text().splitlines() if "objects frozen" in line]
    assert len(frozen) == 1, frozen
    assert int(frozen[0].split(" start-up objects")[0].rsplit(" ", 1)[-1]) > 10_000
