"""The routes a router polls (/v1/loads, /server_info, /model_info) on a scripted engine:
shapes, keys and the loading state, fast. The real router reads them in test_fleet.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from engine.config import EngineConfig
from server.app import create_app
from server.args import ServerArgs
from server.fleet_info import load_snapshot
from tests.integration.fake_engine import FakeEngine

KEY = "fleet-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROUTES = ("/v1/loads", "/server_info", "/model_info")


class LoadedEngine(FakeEngine):
    """A fake whose load numbers the test sets."""

    numbers: dict[str, float] = {}  # noqa: RUF012 (replaced per instance)

    def stats(self) -> dict[str, float]:
        return {**super().stats(), **self.numbers}


@pytest.fixture
def served(tools: SimpleNamespace) -> Iterator[tuple[LoadedEngine, Any]]:
    holder: dict[str, LoadedEngine] = {}

    def factory(config: EngineConfig) -> LoadedEngine:
        holder["engine"] = LoadedEngine(config)
        holder["engine"].numbers = {}
        return holder["engine"]

    args = ServerArgs(engine=EngineConfig(page_size=4), api_key=KEY)
    with tools.ThreadServer(create_app(args, engine_factory=factory)) as srv:
        assert tools.wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 200)
        yield holder["engine"], srv


def test_loads_shape_and_numbers(served: tuple[LoadedEngine, Any]) -> None:
    engine, srv = served
    engine.numbers = {"running": 3, "waiting": 2, "kv_used": 700, "kv_protected": 324}
    body = httpx.get(srv.base_url + "/v1/loads?include=core,disagg,queues,memory", headers=AUTH)
    assert body.status_code == 200
    data = body.json()
    assert set(data) == {"timestamp", "dp_rank_count", "loads"}
    assert data["dp_rank_count"] == 1
    assert data["loads"] == [
        {
            "dp_rank": 0,
            "num_running_reqs": 3,
            "num_waiting_reqs": 2,
            # own slots plus the locked prefix-cache slots they read
            "num_used_tokens": 1024,
            "max_total_num_tokens": 4096,
            "token_usage": 0.25,
        }
    ]
    engine.numbers = {"running": 0, "waiting": 0, "kv_used": 0, "kv_protected": 0}
    idle = httpx.get(srv.base_url + "/v1/loads", headers=AUTH).json()["loads"][0]
    assert (idle["num_running_reqs"], idle["num_used_tokens"], idle["token_usage"]) == (0, 0, 0.0)


def test_token_usage_stays_in_range() -> None:
    assert load_snapshot({"kv_total": 0})["token_usage"] == 0.0
    over = load_snapshot({"kv_total": 100, "kv_used": 90, "kv_protected": 30})
    assert over["token_usage"] == 1.0


def test_server_and_model_info(served: tuple[LoadedEngine, Any]) -> None:
    _, srv = served
    info = httpx.get(srv.base_url + "/server_info", headers=AUTH).json()
    assert info["served_model_name"] == "fake-model"
    assert info["model_path"] == "fake-model"
    assert info["version"] and info["device"] == "cpu"
    assert info["max_total_tokens"] == 4096 and info["context_length"] == 256
    assert info["cache"]["page_size"] == 4
    assert info["cache"]["enable_prefix_cache"] is True
    assert info["cache"]["enable_hierarchical_cache"] is False
    model = httpx.get(srv.base_url + "/model_info", headers=AUTH).json()
    assert (model["model_path"], model["is_generation"]) == ("fake-model", True)


def test_routes_need_the_key(served: tuple[LoadedEngine, Any]) -> None:
    _, srv = served
    for route in ROUTES:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            response = httpx.get(srv.base_url + route, headers=headers)
            assert response.status_code == 401, (route, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(srv.base_url + "/health").status_code == 200


def test_loading_is_503(tools: SimpleNamespace) -> None:
    gate = threading.Event()

    def factory(config: EngineConfig) -> FakeEngine:
        gate.wait(20)
        return FakeEngine(config)

    args = ServerArgs(engine=EngineConfig(), api_key=KEY)
    with tools.ThreadServer(create_app(args, engine_factory=factory)) as srv:
        for route in ROUTES:
            response = httpx.get(srv.base_url + route, headers=AUTH)
            assert response.status_code == 503, route
            assert response.json()["error"]["code"] == "loading"
        gate.set()
        assert tools.wait_until(
            lambda: httpx.get(srv.base_url + "/v1/loads", headers=AUTH).status_code == 200
        )
