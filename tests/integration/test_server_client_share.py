"""The peer address of every request reaches the engine as ``SamplingParams.client``
(the scheduler's fair share of running slots counts by it), on both routes and for every
choice of an n > 1 request."""

from __future__ import annotations

from types import SimpleNamespace

import httpx

from engine.config import EngineConfig
from server.app import create_app
from server.args import ServerArgs
from tests.integration.fake_engine import FakeEngine


def test_the_peer_address_reaches_the_engine(tools: SimpleNamespace) -> None:
    holder: dict[str, FakeEngine] = {}

    def factory(config: EngineConfig) -> FakeEngine:
        holder["engine"] = FakeEngine(config)
        return holder["engine"]

    with tools.ThreadServer(create_app(ServerArgs(engine=EngineConfig()), factory)) as srv:
        assert tools.wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 200)
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))
        with other:
            answer = other.post(
                srv.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 2}
            )
            assert answer.status_code == 200, answer.text
        messages = [{"role": "user", "content": "hi"}]
        answer = httpx.post(
            srv.base_url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}
        )
        assert answer.status_code == 200, answer.text
    clients = [params.client for _, params in holder["engine"].calls]
    assert clients == ["127.0.0.2", "127.0.0.2", "127.0.0.1"]
