"""Server behaviour that a real model makes slow or hard to provoke, on a scripted engine:
loading and failed-load states, queue-full 503s, a dead loop, fan-out of n and seeds,
disconnect aborts, auth and body limits. Clients are the official ``openai`` and httpx."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from engine.config import EngineConfig
from engine.kvcache.miss_reasons import MISS_REASONS
from server.__main__ import uvicorn_config
from server.app import create_app
from server.args import ServerArgs
from tests.integration.fake_engine import FakeEngine

KEY = "fake-key"


Fake = tuple[FakeEngine, Any]


def _args(**kw: Any) -> ServerArgs:
    return ServerArgs(engine=EngineConfig(), api_key=KEY, max_body_bytes=4096, **kw)


@pytest.fixture
def fake(tools: SimpleNamespace) -> Iterator[Fake]:
    holder: dict[str, FakeEngine] = {}

    def factory(config: EngineConfig) -> FakeEngine:
        holder["engine"] = FakeEngine(config, step_delay=0.002)
        return holder["engine"]

    with tools.ThreadServer(create_app(_args(), engine_factory=factory)) as srv:
        assert tools.wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 200)
        yield holder["engine"], srv
    assert holder["engine"].shutdown_called


def _client(srv: Any, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0, **kw)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_loading_then_ready(tools: SimpleNamespace) -> None:
    gate = threading.Event()

    def factory(config: EngineConfig) -> FakeEngine:
        gate.wait(20)
        return FakeEngine(config)

    with tools.ThreadServer(create_app(_args(), engine_factory=factory)) as srv:
        health = httpx.get(srv.base_url + "/health")
        assert health.status_code == 503
        assert health.json()["error"]["code"] == "loading"
        models = httpx.get(srv.base_url + "/v1/models", headers=_auth())
        assert models.status_code == 503 and models.headers["Retry-After"]
        gate.set()
        assert tools.wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 200)
        # The details are behind the key; a probe without it sees the status only.
        assert httpx.get(srv.base_url + "/health").json() == {"status": "ok"}
        details = httpx.get(srv.base_url + "/health", headers=_auth()).json()
        assert details["kv_total_tokens"] == 4096


def test_on_ready_runs_once_before_health_turns_200(tools: SimpleNamespace) -> None:
    # The server process freezes start-up's objects there (engine/heap.py).
    gate = threading.Event()
    ran: list[float] = []

    def factory(config: EngineConfig) -> FakeEngine:
        gate.wait(20)
        return FakeEngine(config)

    app = create_app(_args(), engine_factory=factory, on_ready=lambda: ran.append(time.monotonic()))
    with tools.ThreadServer(app) as srv:
        assert httpx.get(srv.base_url + "/health").status_code == 503 and not ran
        gate.set()
        assert tools.wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 200)
        ready_at = time.monotonic()
        assert len(ran) == 1 and ran[0] < ready_at
        httpx.get(srv.base_url + "/health")
        assert len(ran) == 1


def test_load_failure_is_reported_and_fatal(tools: SimpleNamespace) -> None:
    fatal: list[BaseException] = []

    def factory(config: EngineConfig) -> FakeEngine:
        raise FileNotFoundError("no model at /nowhere")

    app = create_app(_args(), engine_factory=factory, on_fatal=fatal.append)
    with tools.ThreadServer(app) as srv:
        assert tools.wait_until(lambda: bool(fatal))
        assert isinstance(fatal[0], FileNotFoundError)
        assert httpx.get(srv.base_url + "/health").json()["error"]["code"] == "failed"
        resp = httpx.post(srv.base_url + "/v1/completions", headers=_auth(), json={"prompt": "x"})
        # The cause stays in the log (under the error id the client gets), not in the body.
        message = resp.json()["error"]["message"]
        assert resp.status_code == 503 and "/nowhere" not in message
        assert "error id err-" in message


def test_overloaded_is_503_with_retry_after(fake: Fake) -> None:
    engine, srv = fake
    engine.overloaded = True
    for stream in (False, True):
        resp = httpx.post(
            srv.base_url + "/v1/completions",
            headers=_auth(),
            json={"prompt": "hi", "stream": stream},
        )
        assert resp.status_code == 503
        assert int(resp.headers["Retry-After"]) >= 1
        assert resp.json()["error"]["code"] == "overloaded"
    with pytest.raises(openai.APIStatusError) as info:
        _client(srv).chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "x"}]
        )
    assert info.value.status_code == 503
    engine.overloaded = False
    assert _client(srv).completions.create(model="fake-model", prompt="x").choices


def test_dead_loop_is_503(fake: Fake) -> None:
    engine, srv = fake
    engine.alive = False
    assert httpx.get(srv.base_url + "/health").status_code == 503
    resp = httpx.post(srv.base_url + "/v1/completions", headers=_auth(), json={"prompt": "x"})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_dead"


def test_n_fans_out_with_seeds(fake: Fake) -> None:
    engine, srv = fake
    result = _client(srv).completions.create(
        model="fake-model", prompt=["ab", "cd"], n=3, seed=7, max_tokens=3
    )
    assert [c.index for c in result.choices] == list(range(6))
    ids = [rid for rid, _ in engine.calls]
    assert ids == [f"{result.id}-{k}" for k in range(6)]
    assert [p.seed for _, p in engine.calls] == [7, 8, 9, 7, 8, 9]
    assert result.usage is not None
    assert result.usage.prompt_tokens == 4  # each prompt counted once, not per sample
    assert result.usage.completion_tokens == 18


def test_completion_logprobs_and_echo_format(fake: Fake) -> None:
    _, srv = fake
    result = _client(srv).completions.create(
        model="fake-model", prompt="hey", max_tokens=3, logprobs=1, echo=True
    )
    choice = result.choices[0]
    assert choice.text == "heyabc"
    lp = choice.logprobs
    assert lp is not None and lp.tokens == ["h", "e", "y", "a", "b", "c"]
    assert lp.token_logprobs == [None, None, None, -0.25, -0.25, -0.25]
    assert lp.text_offset == [0, 1, 2, 3, 4, 5]
    assert lp.top_logprobs is not None and lp.top_logprobs[3] == {"a": -0.25, "b": -2.0}


def test_auth_and_routes(fake: Fake) -> None:
    _, srv = fake
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        resp = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x"}, headers=headers)
        assert resp.status_code == 401
        assert resp.json()["error"]["type"] == "authentication_error"
    assert httpx.post(srv.base_url + "/flush_cache").status_code == 401
    assert httpx.get(srv.base_url + "/metrics").status_code == 401  # follows the key
    assert httpx.get(srv.base_url + "/metrics", headers=_auth()).status_code == 200
    resp = httpx.get(srv.base_url + "/v1/nope", headers=_auth())
    assert resp.status_code == 404 and "error" in resp.json()
    assert httpx.post(srv.base_url + "/flush_cache", headers=_auth()).json() == {"flushed": True}


def test_body_limit(fake: Fake) -> None:
    _, srv = fake
    big = {"prompt": "x" * 5000}
    resp = httpx.post(srv.base_url + "/v1/completions", json=big, headers=_auth())
    assert resp.status_code == 413 and "4096" in resp.json()["error"]["message"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted while reading
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    resp = httpx.post(
        srv.base_url + "/v1/completions",
        content=chunked(),
        headers={**_auth(), "Content-Type": "application/json"},
    )
    assert resp.status_code == 413


def test_disconnect_aborts(fake: Fake, tools: SimpleNamespace) -> None:
    engine, srv = fake
    engine.step_delay = 0.05  # 200 tokens: ~10 s unless aborted
    body = {"model": "fake-model", "prompt": "x", "max_tokens": 200}
    with httpx.stream(
        "POST", srv.base_url + "/v1/completions", headers=_auth(), json={**body, "stream": True}
    ) as resp:
        lines = resp.iter_lines()
        next(lines)
    assert tools.wait_until(lambda: len(engine.aborted) == 1, timeout=5)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.base_url + "/v1/completions", headers=_auth(), json=body, timeout=0.3)
    # Aborted (recorded by the engine when a generation is closed before its end), not
    # finished: no wall-clock bound needed to tell the two apart.
    assert tools.wait_until(lambda: len(engine.aborted) == 2, timeout=5)
    assert not engine.running


def _stream_texts(lines: Iterator[str], count: int) -> list[str]:
    """Text of the next ``count`` completion chunks of an SSE stream."""
    texts: list[str] = []
    for line in lines:
        if line.startswith("data: {"):
            texts.append(json.loads(line[len("data: ") :])["choices"][0]["text"])
            if len(texts) == count:
                break
    return texts


def test_held_stream_stays_live(fake: Fake, tools: SimpleNamespace) -> None:
    """The server ends a stream only when it finishes or the client goes away: a client that
    holds the stream without reading for a while loses nothing and reads on from there."""
    engine, srv = fake
    engine.step_delay = 0.02  # 200 tokens: ~4 s unless aborted
    body = {"prompt": "x", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", srv.base_url + "/v1/completions", headers=_auth(), json=body) as resp:
        # Kept referenced: a dropped iter_lines() iterator is finalized at once, and httpx
        # then closes the connection mid-body (the server rightly aborts).
        lines = resp.iter_lines()
        assert _stream_texts(lines, 3) == ["a", "b", "c"]
        time.sleep(0.5)  # not reading; the server goes on producing
        assert not engine.aborted and len(engine.running) == 1
        assert _stream_texts(lines, 2) == ["d", "e"]
    assert tools.wait_until(lambda: len(engine.aborted) == 1, timeout=5)
    assert not engine.running


def test_metrics_names(fake: Fake, tools: SimpleNamespace) -> None:
    _, srv = fake
    _client(srv).completions.create(model="fake-model", prompt="x", max_tokens=2)
    text = httpx.get(srv.base_url + "/metrics", headers=_auth()).text
    assert tools.metric_value(text, "hiserve:kv_total_tokens", 'tier="device"') == 4096
    assert tools.metric_value(text, "hiserve:prompt_tokens_total") == 10
    assert tools.metric_value(text, "hiserve:cached_prompt_tokens_total", 'source="device"') == 4
    missed = {
        reason: tools.metric_value(text, "hiserve:prompt_tokens_missed_total", f'reason="{reason}"')
        for reason in MISS_REASONS
    }
    assert missed == {**dict.fromkeys(MISS_REASONS, 0), "never_seen": 5, "below_page": 1}
    assert tools.metric_value(text, "hiserve:prefix_cache_hit_rate") == pytest.approx(0.4)
    assert tools.metric_value(text, "hiserve:time_to_first_token_seconds_count") == 1
    assert tools.metric_value(text, "hiserve:inter_token_latency_seconds_count") == 1
    assert tools.metric_value(text, "hiserve:e2e_request_latency_seconds_count") == 1
    # The process's own series (this test's process: the server runs in a thread here).
    status = Path("/proc/self/status").read_text().splitlines()
    rss_kib = int(next(line for line in status if line.startswith("VmRSS")).split()[1])
    resident = tools.metric_value(text, "process_resident_memory_bytes")
    assert resident == pytest.approx(rss_kib * 1024, rel=0.2)
    assert (
        tools.metric_value(
            text, "hiserve:host_tier_info", 'alloc_method="none",enabled="false",pinned="false"'
        )
        == 1
    )


def test_shutdown_grace_aborts_stragglers(tools: SimpleNamespace) -> None:
    holder: list[FakeEngine] = []

    def factory(config: EngineConfig) -> FakeEngine:
        holder.append(FakeEngine(config, step_delay=0.05))  # 200 tokens: ~10 s
        return holder[0]

    args = _args(shutdown_grace=1.0, log_level="warning")
    app = create_app(args, engine_factory=factory)
    # The server's own uvicorn settings: the grace comes from the arguments, as in main().
    # (The real engine's side of the grace: test_server_engine_states.py.)
    srv = tools.ThreadServer(app, config=uvicorn_config(app, args))
    with srv:
        assert tools.wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 200)
        first = threading.Event()
        lines: list[str] = []

        def stream() -> None:
            with (
                contextlib.suppress(httpx.HTTPError),
                httpx.stream(
                    "POST",
                    srv.base_url + "/v1/completions",
                    headers=_auth(),
                    json={"prompt": "x", "max_tokens": 200, "stream": True},
                ) as resp,
            ):
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    lines.append(line)
                    first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(10)
        srv.server.should_exit = True  # what SIGTERM does
        reader.join(20)
        srv.thread.join(20)
        assert not srv.thread.is_alive()
    engine = holder[0]
    assert len(engine.aborted) == 1 and not engine.running
    assert engine.shutdown_called
    assert "data: [DONE]" not in lines  # cut at the grace period, not run to the end


def test_copies_are_grouped_and_their_prompt_tokens_budgeted(tools: SimpleNamespace) -> None:
    """Issue 25 item 5: n copies each read the whole prompt; n x prompt tokens is capped
    (400 naming n), and the copies reach the engine as one group for its scheduler."""
    holder: dict[str, FakeEngine] = {}

    def factory(config: EngineConfig) -> FakeEngine:
        holder["engine"] = FakeEngine(config, step_delay=0.001)
        return holder["engine"]

    app = create_app(_args(max_choice_prompt_tokens=100), engine_factory=factory)
    with tools.ThreadServer(app) as srv:
        assert tools.wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 200)
        prompt = "x" * 30  # 30 tokens (one per byte)
        over = httpx.post(
            srv.base_url + "/v1/completions",
            json={"prompt": prompt, "n": 4, "max_tokens": 1},
            headers=_auth(),
        )
        assert over.status_code == 400, over.text
        error = over.json()["error"]
        assert error["param"] == "n" and error["code"] == "too_many_prompt_tokens"
        assert "120" in error["message"] and "--max-choice-prompt-tokens" in error["message"]
        assert not holder["engine"].calls  # refused before anything was queued
        fine = _client(srv).completions.create(
            model="fake-model", prompt=[prompt, "y" * 20], n=2, max_tokens=1
        )
        assert len(fine.choices) == 4  # (30 + 20) x 2 = 100 tokens: at the cap
        single = _client(srv).completions.create(model="fake-model", prompt="z" * 200)
        assert len(single.choices) == 1  # one choice is never capped here
    groups = [params.group for _, params in holder["engine"].calls]
    assert len(groups) == 5 and None not in groups
    assert len(set(groups[:4])) == 1 and groups[4] != groups[0]
