"""API key: every protected route and method answers 401 (with ``WWW-Authenticate``)
without the right bearer key, before the body is read; the scheme is case-insensitive;
open routes stay open."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from engine.config import EngineConfig
from server.app import create_app
from server.args import ServerArgs
from tests.integration.fake_engine import FakeEngine

KEY = "s3cret-Key"
LIMIT = 4096
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# (method, path, JSON body or None): every route that needs the key, with each method
# it serves, and methods it does not serve (still 401, not 405: nothing is disclosed).
PROTECTED: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/fake-model", None),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/flush_cache", None),
    ("GET", "/v1/completions", None),
    ("GET", "/v1/chat/completions", None),
    ("DELETE", "/v1/models", None),
    ("PUT", "/v1/chat/completions", CHAT),
    ("GET", "/v1", None),
    ("GET", "/v1/no-such-route", None),
    ("GET", "/metrics", None),
    ("GET", "/server_info", None),
    ("GET", "/model_info", None),
    ("GET", "/v1/loads", None),
]
ADMIN_KEY = "fleet-Admin-key"
ADMIN_ROUTES = [("POST", "/flush_cache"), ("GET", "/server_info"), ("GET", "/model_info")]


def _serve(tools: SimpleNamespace, **kw: Any) -> Any:
    def factory(config: EngineConfig) -> FakeEngine:
        return FakeEngine(config)

    args = ServerArgs(engine=EngineConfig(), max_body_bytes=LIMIT, **kw)
    server = tools.ThreadServer(create_app(args, engine_factory=factory)).__enter__()
    assert tools.wait_until(lambda: httpx.get(server.base_url + "/health").status_code == 200)
    return server


@pytest.fixture
def srv(tools: SimpleNamespace) -> Iterator[Any]:
    server = _serve(tools, api_key=KEY)
    yield server
    server.__exit__()


@pytest.fixture
def fleet_srv(tools: SimpleNamespace) -> Iterator[Any]:
    server = _serve(tools, api_key=KEY, admin_key=ADMIN_KEY)
    yield server
    server.__exit__()


def _call(srv: Any, method: str, path: str, body: Any, auth: str | None) -> httpx.Response:
    headers = {} if auth is None else {"Authorization": auth}
    return httpx.request(method, srv.base_url + path, json=body, headers=headers, timeout=30)


def _is_401(resp: httpx.Response) -> bool:
    if resp.status_code != 401:
        return False
    assert resp.headers["WWW-Authenticate"] == "Bearer"
    error = resp.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert "Authorization: Bearer" in error["message"]  # says what to send
    return True


@pytest.mark.parametrize(
    "auth",
    [
        None,
        "",
        "Bearer",  # (a trailing space is stripped from header values on the wire)
        f"Bearer {KEY}x",
        f"Bearer {KEY[:-1]}",
        f"Bearer {KEY.upper()}",  # the key itself is case-sensitive
        f"Basic {KEY}",
        KEY,
        f"Bearer{KEY}",
        f"Bearer {KEY} {KEY}",
    ],
    ids=lambda a: repr(a),
)
def test_every_protected_route_and_method_needs_the_key(srv: Any, auth: str | None) -> None:
    for method, path, body in PROTECTED:
        resp = _call(srv, method, path, body, auth)
        assert _is_401(resp), (method, path, resp.status_code, resp.text)


@pytest.mark.parametrize(
    "auth",
    [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", f"BeArEr {KEY}", f"Bearer   {KEY}"],
    ids=["canonical", "lower", "upper", "mixed", "padded"],
)
def test_scheme_is_case_insensitive_and_padding_tolerated(srv: Any, auth: str) -> None:
    expected = {
        ("GET", "/v1/models"): 200,
        ("GET", "/v1/models/fake-model"): 200,
        ("POST", "/v1/completions"): 200,
        ("POST", "/v1/chat/completions"): 200,
        ("POST", "/flush_cache"): 200,
        ("GET", "/v1/completions"): 405,
        ("GET", "/v1/chat/completions"): 405,
        ("DELETE", "/v1/models"): 405,
        ("PUT", "/v1/chat/completions"): 405,
        ("GET", "/v1"): 404,
        ("GET", "/v1/no-such-route"): 404,
        ("GET", "/metrics"): 200,
        ("GET", "/server_info"): 200,
        ("GET", "/model_info"): 200,
        ("GET", "/v1/loads"): 200,
    }
    for method, path, body in PROTECTED:
        resp = _call(srv, method, path, body, auth)
        assert resp.status_code == expected[(method, path)], (method, path, resp.text)


def test_open_routes_need_no_key(srv: Any) -> None:
    assert httpx.get(srv.base_url + "/health").status_code == 200


def test_metrics_public_opens_only_metrics(tools: SimpleNamespace) -> None:
    server = _serve(tools, api_key=KEY, metrics_public=True)
    try:
        assert httpx.get(server.base_url + "/metrics").status_code == 200
        assert _is_401(httpx.get(server.base_url + "/v1/models"))
        assert _is_401(httpx.post(server.base_url + "/flush_cache"))
    finally:
        server.__exit__()


def test_admin_routes_refuse_the_client_key(fleet_srv: Any) -> None:
    """With an admin key (the fleet's router/replica credential), a client key opens the
    serving routes and /metrics only."""
    client, admin = f"Bearer {KEY}", f"Bearer {ADMIN_KEY}"
    for method, path in ADMIN_ROUTES:
        assert _is_401(_call(fleet_srv, method, path, None, client)), path
        assert _call(fleet_srv, method, path, None, admin).status_code == 200, path
    assert _is_401(_call(fleet_srv, "GET", "/v1/loads", None, client))
    assert _call(fleet_srv, "GET", "/v1/loads", None, admin).status_code == 200
    # the admin key opens the serving routes too (the router's own probes use it)
    for auth in (client, admin):
        assert _call(fleet_srv, "GET", "/v1/models", None, auth).status_code == 200
        resp = _call(fleet_srv, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}, auth)
        assert resp.status_code == 200, resp.text
        assert _call(fleet_srv, "GET", "/metrics", None, auth).status_code == 200
        assert "device" in _call(fleet_srv, "GET", "/health", None, auth).json()
    assert _is_401(_call(fleet_srv, "GET", "/metrics", None, None))
    assert "device" not in _call(fleet_srv, "GET", "/health", None, None).json()


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_keyless_oversized_body_is_401_not_413(srv: Any, declared: bool) -> None:
    """Without the key the body is never read: an anonymous client learns nothing about
    the limit and cannot make the server buffer anything."""
    body = b'{"prompt": "' + b"x" * (4 * LIMIT) + b'"}'

    def chunks() -> Iterator[bytes]:  # no Content-Length
        for i in range(0, len(body), 1024):
            yield body[i : i + 1024]

    resp = httpx.post(
        srv.base_url + "/v1/completions",
        content=body if declared else chunks(),
        headers={"Content-Type": "application/json"},
    )
    assert _is_401(resp), (resp.status_code, resp.text)
    # The same body with the key is over the limit.
    with_key = httpx.post(
        srv.base_url + "/v1/completions",
        content=body if declared else chunks(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    assert with_key.status_code == 413
