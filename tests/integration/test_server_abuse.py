"""Single requests that used to stall the whole server (issue 18), against a real server on
the default model: each gets a fast, clear 4xx (or is served at the cost of one prefill),
while a canary request sent meanwhile is served."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

KEY = "abuse-key"
CMPL = "/v1/completions"
BOUND_S = 60.0  # generous: a loaded 2-core machine; the old behaviour took 20-200 s
FLAGS = [
    "--max-choices",
    "64",
    "--max-stop-token-ids",
    "32",
    "--max-logprobs",
    "8",
    "--max-body-bytes",
    str(32 << 20),
]


@pytest.fixture(scope="module")
def server(tools: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    proc = tools.ServerProcess(
        tmp_path_factory.mktemp("abuse") / "server.log", extra_args=FLAGS, api_key=KEY
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _post(server: Any, body: bytes | dict[str, Any], path: str = CMPL) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.base_url + path, content=content, headers=headers, timeout=300)


def _with_canary(server: Any, abuse: Callable[[], httpx.Response]) -> httpx.Response:
    """Send ``abuse``; meanwhile a small completion and /health must be served."""
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        future = pool.submit(abuse)
        canary = _post(server, {"prompt": "The sky is", "max_tokens": 2})
        health = httpx.get(server.base_url + "/health", timeout=BOUND_S)
        resp = future.result(timeout=BOUND_S * 2)
        elapsed = time.monotonic() - started
    assert canary.status_code == 200, canary.text
    assert len(canary.json()["choices"]) == 1
    assert health.status_code == 200
    assert elapsed < BOUND_S, f"the request took {elapsed:.1f} s"
    return resp


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text[:500]
    error: dict[str, Any] = resp.json()["error"]
    return error


def test_prompt_list_times_n_is_capped_before_any_work(server: Any) -> None:
    body = {"prompt": ["hi there"] * 1000, "n": 128, "max_tokens": 1}
    error = _error(_with_canary(server, lambda: _post(server, body)), 400)
    assert error["code"] == "too_many_choices" and error["param"] == "n"
    assert "128000" in error["message"] and "64" in error["message"]


def test_huge_stop_token_ids_are_capped(server: Any) -> None:
    ids = ",".join(str(i % 40000) for i in range(2_000_000))
    body = f'{{"prompt": "hi", "n": 64, "max_tokens": 1, "stop_token_ids": [{ids}]}}'.encode()
    error = _error(_with_canary(server, lambda: _post(server, body)), 400)
    assert error["param"] == "stop_token_ids" and "32" in error["message"]


def test_text_that_cannot_fit_is_refused_before_tokenizing(server: Any) -> None:
    body = {"prompt": "lorem ipsum " * 660_000, "max_tokens": 1}  # 7.9 MB
    started = time.monotonic()
    error = _error(_with_canary(server, lambda: _post(server, body)), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "bytes" in error["message"]
    # The same for chat content.
    chat = {"messages": [{"role": "user", "content": "lorem ipsum " * 660_000}]}
    error = _error(_post(server, chat, "/v1/chat/completions"), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert time.monotonic() - started < BOUND_S


def _metric(server: Any, tools: SimpleNamespace, name: str, labels: str = "") -> float:
    headers = {"Authorization": f"Bearer {KEY}"}
    text = httpx.get(server.base_url + "/metrics", headers=headers, timeout=30).text
    return float(tools.metric_value(text, name, labels))


def _computed(server: Any, tools: SimpleNamespace) -> float:
    prompt = _metric(server, tools, "hiserve:prompt_tokens_total")
    cached = sum(
        _metric(server, tools, "hiserve:cached_prompt_tokens_total", f'source="{tier}"')
        for tier in ("device", "host")
    )
    return prompt - cached


def test_copies_of_an_n_request_prefill_their_prompt_once(
    server: Any, tools: SimpleNamespace
) -> None:
    rng = random.Random(18)
    words = [rng.choice(["river", "stone", "cloud", "lamp", "field", "quiet"]) for _ in range(600)]
    prompt = " ".join(words)
    body = {"prompt": prompt, "n": 4, "max_tokens": 1, "echo": True, "logprobs": 8}
    before = _computed(server, tools)
    resp = _with_canary(server, lambda: _post(server, body))
    assert resp.status_code == 200, resp.text[:500]
    out = resp.json()
    prompt_tokens = out["usage"]["prompt_tokens"]
    assert prompt_tokens > 500 and len(out["choices"]) == 4
    for choice in out["choices"]:
        assert choice["text"].startswith(prompt)
        assert len(choice["logprobs"]["tokens"]) == prompt_tokens + 1
    computed = _computed(server, tools) - before
    canary_tokens = 4  # "The sky is" is a handful of tokens, computed once (or cached)
    # The prompt once, then one token per later copy (page size 1).
    assert computed <= prompt_tokens + 3 + canary_tokens, computed
    over = _error(_post(server, {**body, "logprobs": 9}), 400)
    assert over["param"] == "logprobs" and "--max-logprobs" in over["message"]
