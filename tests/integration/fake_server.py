"""A server over the scripted FakeEngine and the request bodies its tests share.

Used by the structured-output tests (test_server_constraints_fake.py) and the tool-call
tests (test_server_tools_fake.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import httpx
import openai

from engine.config import EngineConfig
from server.app import create_app
from server.args import ServerArgs
from tests.integration.fake_engine import FakeEngine

KEY = "fake-key"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

Fake = tuple[FakeEngine, Any]


@contextmanager
def fake_server(tools: SimpleNamespace) -> Iterator[Fake]:
    """A live server on a FakeEngine that answers at once: (engine, server)."""
    holder: dict[str, FakeEngine] = {}

    def factory(config: EngineConfig) -> FakeEngine:
        engine = FakeEngine(config, step_delay=0.0)
        engine.max_model_len = 4096  # room for the tool instructions (one token per byte)
        holder["engine"] = engine
        return engine

    args = ServerArgs(engine=EngineConfig(), api_key=KEY)
    with tools.ThreadServer(create_app(args, engine_factory=factory)) as srv:
        assert tools.wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 200)
        yield holder["engine"], srv


def client_of(srv: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0)


def post(srv: Any, route: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.post(srv.base_url + route, json=body, headers=headers, timeout=30)
