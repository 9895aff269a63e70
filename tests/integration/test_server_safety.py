"""Safe defaults of the HTTP front, on the scripted engine: JSON content type (415), the
Host allow-list, /health without the key, docs routes off, errors that keep their causes
in the log, per-request caps checked before any work, redacted access logs."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from engine.config import EngineConfig
from server.app import create_app
from server.args import ServerArgs
from server.log_safety import RedactingFilter, exposure_warning, is_loopback, redact_url
from tests.integration.fake_engine import ByteTokenizer, FakeEngine

KEY = "safety-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CMPL = "/v1/completions"


def _args(**kw: Any) -> ServerArgs:
    base: dict[str, Any] = dict(engine=EngineConfig(), api_key=KEY, max_body_bytes=1 << 20)
    base.update(kw)
    return ServerArgs(**base)


class _SecretTemplateTokenizer(ByteTokenizer):
    """A chat template that fails with text the client must not see."""

    def apply_chat_template(self, messages: Any, **kw: Any) -> str:
        raise RuntimeError("jinja2 internals at /srv/secret/template.jinja line 3")


@pytest.fixture
def served(tools: SimpleNamespace) -> Iterator[Any]:
    """A server factory: ``served(**server_args)`` -> a running ThreadServer."""
    stack: list[Any] = []

    def start(tokenizer: Any = None, **kw: Any) -> Any:
        def factory(config: EngineConfig) -> FakeEngine:
            engine = FakeEngine(config)
            if tokenizer is not None:
                engine.tokenizer = tokenizer
            return engine

        srv = tools.ThreadServer(create_app(_args(**kw), engine_factory=factory))
        srv.__enter__()
        stack.append(srv)
        assert tools.wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 200)
        return srv

    yield start
    for srv in stack:
        srv.__exit__(None, None, None)


def test_bodies_must_be_sent_as_json(served: Any) -> None:
    srv = served()
    url = srv.base_url + CMPL
    body = b'{"prompt": "hi", "max_tokens": 2}'
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = dict(AUTH)
        if content_type is not None:
            headers["Content-Type"] = content_type
        resp = httpx.post(url, content=body, headers=headers)
        assert resp.status_code == 415, resp.text
        assert "Content-Type: application/json" in resp.json()["error"]["message"]
    ok = httpx.post(
        url, content=body, headers={**AUTH, "Content-Type": "application/json; charset=utf-8"}
    )
    assert ok.status_code == 200, ok.text
    # A bodiless admin POST needs no content type.
    assert httpx.post(srv.base_url + "/flush_cache", headers=AUTH).status_code == 200


def test_allowed_hosts_reject_other_host_headers(served: Any) -> None:
    srv = served(allowed_hosts=("127.0.0.1", "*.example.com"))
    url = srv.base_url + CMPL
    body = {"prompt": "hi", "max_tokens": 1}
    rebound = httpx.post(url, json=body, headers={**AUTH, "Host": "attacker.test"})
    assert rebound.status_code == 400 and rebound.json()["error"]["code"] == "invalid_host"
    assert httpx.post(url, json=body, headers=AUTH).status_code == 200  # 127.0.0.1:port
    named = httpx.post(url, json=body, headers={**AUTH, "Host": "api.example.com:80"})
    assert named.status_code == 200
    # Probes address pods by IP: /health answers under any Host.
    assert httpx.get(srv.base_url + "/health", headers={"Host": "10.1.2.3"}).status_code == 200


def test_health_shows_details_only_with_the_key(served: Any) -> None:
    srv = served()
    public = httpx.get(srv.base_url + "/health")
    assert public.status_code == 200 and public.json() == {"status": "ok"}
    wrong = httpx.get(srv.base_url + "/health", headers={"Authorization": "Bearer nope"})
    assert wrong.json() == {"status": "ok"}
    detail = httpx.get(srv.base_url + "/health", headers=AUTH).json()
    assert detail["status"] == "ok" and detail["device"] == "cpu"


def test_docs_routes_are_off_unless_enabled(served: Any) -> None:
    off, on = served(), served(enable_docs=True)
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(off.base_url + path).status_code == 404, path
        assert httpx.get(on.base_url + path).status_code == 200, path


def test_template_errors_reach_the_client_as_an_id(
    served: Any, caplog: pytest.LogCaptureFixture
) -> None:
    srv = served(tokenizer=_SecretTemplateTokenizer())
    with caplog.at_level(logging.ERROR, logger="hiserve.server"):
        resp = httpx.post(
            srv.base_url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            headers=AUTH,
        )
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "messages"
    assert "secret" not in error["message"] and "jinja" not in error["message"]
    error_id = error["message"].split("error id ")[1].split(")")[0]
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and "secret/template.jinja" in str(logged[0].exc_info[1])  # type: ignore[index]


def test_caps_are_checked_before_any_per_choice_work(served: Any) -> None:
    srv = served(max_choices=64)
    canary: dict[str, float] = {}
    start = time.monotonic()
    many = httpx.post(
        srv.base_url + CMPL,
        json={"prompt": ["x"] * 1000, "n": 128, "max_tokens": 1},
        headers=AUTH,
        timeout=60,
    )
    assert many.status_code == 400, many.text
    assert many.json()["error"]["code"] == "too_many_choices"
    assert "128000" in many.json()["error"]["message"]
    stops = httpx.post(
        srv.base_url + CMPL,
        json={"prompt": "x", "n": 8, "max_tokens": 1, "stop_token_ids": list(range(50_000))},
        headers=AUTH,
        timeout=60,
    )
    assert stops.status_code == 400 and stops.json()["error"]["param"] == "stop_token_ids"
    assert time.monotonic() - start < 30  # generous for a loaded machine
    ok = httpx.post(srv.base_url + CMPL, json={"prompt": "x", "max_tokens": 2}, headers=AUTH)
    canary["status"] = ok.status_code
    assert canary["status"] == 200
    # Within the cap, n x prompts still fans out (one validation per prompt).
    fine = httpx.post(
        srv.base_url + CMPL,
        json={"prompt": ["a", "b"], "n": 32, "max_tokens": 1, "seed": 7},
        headers=AUTH,
    )
    assert fine.status_code == 200 and len(fine.json()["choices"]) == 64


def test_access_log_urls_are_redacted() -> None:
    assert redact_url("/v1/models?api_key=sk-123&x=1") == "/v1/models?api_key=***&x=1"
    assert redact_url("/x?X-Api-Key=a&token=b&page=2") == "/x?X-Api-Key=***&token=***&page=2"
    assert redact_url("http://user:pw@host/p") == "http://***@host/p"
    assert redact_url("/v1/completions") == "/v1/completions"
    # issue 25 item 11: ?bearer= was logged in clear
    assert redact_url("/v1/models?bearer=sk-9&n=1") == "/v1/models?bearer=***&n=1"
    assert redact_url("/metrics?Bearer_Token=sk-9") == "/metrics?Bearer_Token=***"
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5", "GET", "/health?access_token=hunter2", "1.1", 200),
        None,
    )
    assert RedactingFilter().filter(record)
    assert "hunter2" not in record.getMessage() and "access_token=***" in record.getMessage()


def test_access_log_filter_is_installed_by_the_app() -> None:
    create_app(_args())
    access = logging.getLogger("uvicorn.access")
    assert sum(isinstance(f, RedactingFilter) for f in access.filters) == 1
    create_app(_args())  # idempotent
    assert sum(isinstance(f, RedactingFilter) for f in access.filters) == 1


def test_exposure_warning(caplog: pytest.LogCaptureFixture) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.0.0.2")
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("0.0.0.0", "key") is None
    with caplog.at_level(logging.WARNING, logger="hiserve.server"):
        create_app(_args(host="0.0.0.0", api_key=None))
    assert any("WITHOUT an API key" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hiserve.server"):
        create_app(_args(host="0.0.0.0"))
    assert not any("WITHOUT an API key" in r.getMessage() for r in caplog.records)
