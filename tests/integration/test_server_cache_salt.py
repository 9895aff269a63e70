"""cache_salt over HTTP: the field on both routes (official ``openai`` client), its 400s,
--require-cache-salt, and the real server's caches partitioned by it.

The flag and validation tests run on the scripted engine (it records the
SamplingParams each request reached the engine with); the partition test runs on the
real server, whose only reference needed is "same prompt, different salt: 0 cached".
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from engine.cache_salt import MAX_CACHE_SALT_CHARS, SALT_BUCKETS, salt_bucket, salt_digest
from engine.config import EngineConfig
from engine.engine_stats import salt_counter
from server.app import create_app
from server.args import ServerArgs, parse_args
from tests.integration.fake_engine import FakeEngine

PROMPT = list(range(100, 180))
CHAT = [{"role": "user", "content": "Name the planets of the solar system, in order."}]


@pytest.fixture
def serve(tools: SimpleNamespace) -> Iterator[Any]:
    servers: list[Any] = []

    def start(**kw: Any) -> tuple[Any, FakeEngine]:
        holder: dict[str, FakeEngine] = {}

        def factory(config: EngineConfig) -> FakeEngine:
            holder["engine"] = FakeEngine(config)
            return holder["engine"]

        srv = tools.ThreadServer(create_app(ServerArgs(engine=EngineConfig(), **kw), factory))
        servers.append(srv.__enter__())
        assert tools.wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 200)
        return srv, holder["engine"]

    yield start
    for srv in servers:
        srv.__exit__(None, None, None)


def client_of(srv: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)


def test_the_salt_reaches_the_engine_on_both_routes(serve: Any) -> None:
    srv, engine = serve()
    client = client_of(srv)
    client.completions.create(
        model="fake-model", prompt=PROMPT, max_tokens=2, n=2, extra_body={"cache_salt": "team-a"}
    )
    client.chat.completions.create(
        model="fake-model",
        messages=CHAT,
        max_tokens=2,
        extra_body={"cache_salt": "team-b"},  # type: ignore[arg-type]
    )
    client.completions.create(model="fake-model", prompt=PROMPT, max_tokens=2)
    salts = [params.cache_salt for _, params in engine.calls]
    assert salts == ["team-a", "team-a", "team-b", None]


def test_bad_salts_are_a_400_naming_the_field(serve: Any) -> None:
    srv, engine = serve()
    for bad in ("", "x" * (MAX_CACHE_SALT_CHARS + 1), 12, ["a"], {"a": 1}):
        for route, body in (
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": CHAT}),
        ):
            answer = httpx.post(srv.base_url + route, json={**body, "cache_salt": bad})
            assert answer.status_code == 400, (bad, answer.text)
            assert answer.json()["error"]["param"] == "cache_salt", answer.text
    assert engine.calls == []
    longest = "x" * MAX_CACHE_SALT_CHARS
    answer = httpx.post(
        srv.base_url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 1, "cache_salt": longest},
    )
    assert answer.status_code == 200, answer.text


def test_require_cache_salt(serve: Any) -> None:
    srv, engine = serve(require_cache_salt=True)
    client = client_of(srv)
    for call in (
        lambda: client.completions.create(model="fake-model", prompt="hi", max_tokens=1),
        lambda: client.chat.completions.create(model="fake-model", messages=CHAT, max_tokens=1),  # type: ignore[arg-type]
    ):
        with pytest.raises(openai.BadRequestError) as err:
            call()
        assert err.value.status_code == 400
        body = err.value.body
        assert isinstance(body, dict) and body["param"] == "cache_salt"
        assert body["code"] == "cache_salt_required"
    assert engine.calls == []
    client.completions.create(
        model="fake-model", prompt="hi", max_tokens=1, extra_body={"cache_salt": "t"}
    )
    assert [params.cache_salt for _, params in engine.calls] == ["t"]


def test_cache_salt_from_key_partitions_by_bearer_token(serve: Any) -> None:
    srv, engine = serve(cache_salt_from_key=True)

    def cached(token: str | None, salt: str | None) -> int:
        body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        answer = httpx.post(srv.base_url + "/v1/completions", json=body, headers=headers)
        assert answer.status_code == 200, answer.text
        return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    hit = len(PROMPT) - 1
    assert cached("key-a", "shared") == 0
    assert cached("key-b", "shared") == 0  # same salt string, another key: its own cache
    assert cached("key-a", "shared") == hit
    assert cached("key-a", None) == 0  # the key alone is a partition of its own
    assert cached(None, "shared") == 0  # no token: the body salt as sent
    assert cached(None, "shared") == hit

    def derived(token: str, salt: str) -> str:
        seed = b"hiserve-key-salt\0" + token.encode()
        return "key:" + hashlib.sha256(seed + b"\0" + salt.encode()).hexdigest()

    salts = [params.cache_salt for _, params in engine.calls]
    assert salts == [
        derived("key-a", "shared"),
        derived("key-b", "shared"),
        derived("key-a", "shared"),
        derived("key-a", ""),
        "shared",
        "shared",
    ]


def test_metrics_have_sixteen_salt_buckets_and_no_salt(
    tools: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/metrics renders the engine's per-bucket counters as exactly SALT_BUCKETS series
    per family (the engine side is checked in tests/unit/test_cache_salt_engine.py)."""
    stats = FakeEngine.stats

    def with_buckets(self: FakeEngine) -> dict[str, float]:
        return {**stats(self), salt_counter(3, "prompt"): 41, salt_counter(3, "cached"): 40}

    monkeypatch.setattr(FakeEngine, "stats", with_buckets)
    srv = tools.ThreadServer(create_app(ServerArgs(engine=EngineConfig()), FakeEngine))
    with srv:
        assert tools.wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 200)
        text = httpx.get(srv.base_url + "/metrics").text
    for what, value in (("prompt", 41), ("cached", 40)):
        name = f"hiserve:salted_{what}_tokens_total"
        series = [line for line in text.splitlines() if line.startswith(name + "{")]
        assert len(series) == SALT_BUCKETS
        assert tools.metric_value(text, name, 'salt_bucket="3"') == value
        assert tools.metric_value(text, name, 'salt_bucket="4"') == 0


def test_the_flag_is_parsed() -> None:
    assert parse_args([], {}).require_cache_salt is False
    assert parse_args(["--require-cache-salt"], {}).require_cache_salt is True
    assert parse_args([], {"HISERVE_REQUIRE_CACHE_SALT": "1"}).require_cache_salt is True
    assert parse_args([], {}).cache_salt_from_key is False
    assert parse_args(["--cache-salt-from-key"], {}).cache_salt_from_key is True


def test_real_server_partitions_its_cache_by_salt(
    client: openai.OpenAI, model_name: str, http: httpx.Client, tools: SimpleNamespace
) -> None:
    """The real engine behind HTTP: cached_tokens is 0 under another salt, a hit under the
    same salt, and unsalted requests hit each other as before; /metrics counts salted
    requests in 16 salt buckets, never by salt."""
    prompt = "Salted prompt for the partition test. " * 12
    sent: dict[int, list[int]] = {}  # salt bucket -> [prompt tokens, cached tokens]

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        out = client.completions.create(
            model=model_name, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra
        )
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        hit = int(out.usage.prompt_tokens_details.cached_tokens or 0)
        if salt is not None:
            totals = sent.setdefault(salt_bucket(salt_digest(salt)), [0, 0])
            totals[0] += out.usage.prompt_tokens
            totals[1] += hit
        return hit

    before = http.get("/metrics").text
    assert cached("tenant-one") == 0
    assert cached("tenant-two") == 0
    hit = cached("tenant-one")
    assert hit > 0
    assert cached("tenant-two") == hit
    first_plain = cached(None)  # whatever an earlier test left; then a hit like any prompt
    assert first_plain in (0, hit) and cached(None) == hit

    after = http.get("/metrics").text
    for bucket in range(SALT_BUCKETS):
        label = f'salt_bucket="{bucket}"'
        grew = [
            tools.metric_value(after, f"hiserve:salted_{what}_tokens_total", label)
            - tools.metric_value(before, f"hiserve:salted_{what}_tokens_total", label)
            for what in ("prompt", "cached")
        ]
        assert grew == sent.get(bucket, [0, 0]), bucket
    assert "tenant-one" not in after and salt_digest("tenant-one") not in after
