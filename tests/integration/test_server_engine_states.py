"""The server over the real AsyncEngine (tiny random model, loop thread and all): where its
503s really come from, a loop crash reaching requests in flight, and shutdown grace wired
from the server arguments through uvicorn and the lifespan to ``AsyncEngine.shutdown``.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from server.__main__ import uvicorn_config
from server.app import create_app
from server.args import ServerArgs
from tests.unit.stepped_engine import HANG_S, SteppedEngine

KEY = "real-key"
LONG = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


class Served(SimpleNamespace):
    srv: Any
    engine: SteppedEngine
    async_engine: AsyncEngine


@contextlib.contextmanager
def serve(
    tools: SimpleNamespace, model_dir: Path, grace: float = 30.0, **engine_kw: Any
) -> Iterator[Served]:
    """The app on a real AsyncEngine whose Engine can be paced, parked or crashed."""
    config = EngineConfig(
        model=str(model_dir), device="cpu", dtype="float32", kv_cache_tokens=4096, **engine_kw
    )
    args = ServerArgs(engine=config, api_key=KEY, shutdown_grace=grace, log_level="warning")
    served = Served()

    def factory(cfg: EngineConfig) -> AsyncEngine:
        served.engine = SteppedEngine(cfg)
        served.async_engine = AsyncEngine(cfg, engine=served.engine)
        return served.async_engine

    app = create_app(args, engine_factory=factory)
    with tools.ThreadServer(app, config=uvicorn_config(app, args)) as srv:
        served.srv = srv
        ready = tools.wait_until(
            lambda: httpx.get(srv.base_url + "/health").status_code == 200, timeout=HANG_S
        )
        assert ready, "the engine never became ready"
        yield served


def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: {"):
            yield json.loads(line[len("data: ") :])


def test_full_queue_is_503_overloaded(tools: SimpleNamespace, tiny_llama_dir: Path) -> None:
    with serve(tools, tiny_llama_dir, max_running_requests=1, max_waiting_requests=1) as s:
        s.engine.step_delay = 0.01  # LONG runs >= 10 s: it holds the one running slot
        url = s.srv.base_url + "/v1/completions"
        queued_seen = threading.Event()
        release = threading.Event()

        def queued() -> None:  # waits behind the running one, then leaves
            with httpx.stream(
                "POST", url, headers=_auth(), json={**LONG, "stream": True}, timeout=HANG_S
            ) as resp:
                assert resp.status_code == 200
                queued_seen.set()
                release.wait(HANG_S)

        with httpx.stream(
            "POST", url, headers=_auth(), json={**LONG, "stream": True}, timeout=HANG_S
        ) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            next(_events(lines))
            waiter = threading.Thread(target=queued)
            waiter.start()
            assert tools.wait_until(lambda: s.async_engine.stats()["waiting"] == 1, HANG_S)
            for stream in (False, True):
                resp = httpx.post(url, headers=_auth(), json={**LONG, "stream": stream})
                assert resp.status_code == 503
                assert resp.headers["Retry-After"] == "1"
                error = resp.json()["error"]
                assert error["code"] == "overloaded"
                assert "1 requests waiting" in error["message"]
        # The running stream is closed: the queued one is admitted and gets its 200.
        assert queued_seen.wait(HANG_S)
        release.set()
        waiter.join(HANG_S)
        assert tools.wait_until(lambda: s.async_engine.stats()["running"] == 0, HANG_S)


def test_loop_crash_reaches_requests_in_flight(
    tools: SimpleNamespace, tiny_llama_dir: Path
) -> None:
    with serve(tools, tiny_llama_dir) as s:
        s.engine.step_delay = 0.01
        url = s.srv.base_url + "/v1/completions"
        plain: dict[str, Any] = {}

        def non_streaming() -> None:
            resp = httpx.post(url, headers=_auth(), json=LONG, timeout=HANG_S)
            plain.update(status=resp.status_code, body=resp.json())

        with httpx.stream(
            "POST", url, headers=_auth(), json={**LONG, "stream": True}, timeout=HANG_S
        ) as resp:
            assert resp.status_code == 200
            events = _events(resp.iter_lines())
            first = next(events)
            assert first["choices"][0]["finish_reason"] is None
            other = threading.Thread(target=non_streaming)
            other.start()
            assert tools.wait_until(lambda: s.async_engine.stats()["running"] == 2, HANG_S)
            s.engine.crash = RuntimeError("device lost")
            rest = list(events)
        # The stream already had its 200: the error arrives as an SSE event.
        assert rest and "error" in rest[-1], rest[-3:]
        assert rest[-1]["error"]["code"] == "engine_dead"
        # The cause stays in the server log, under the id the client is given.
        message = rest[-1]["error"]["message"]
        assert "the engine is not running (error id err-" in message, message
        assert "device lost" not in message
        other.join(HANG_S)
        assert plain["status"] == 503 and plain["body"]["error"]["code"] == "engine_dead"
        health = httpx.get(s.srv.base_url + "/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "dead"
        after = httpx.post(url, headers=_auth(), json=LONG)
        assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"


def test_shutdown_grace_cuts_a_straggler(tools: SimpleNamespace, tiny_llama_dir: Path) -> None:
    """--shutdown-grace 1: uvicorn waits 1 s for the stream, then cancels it; the engine
    aborts the request, frees its KV, and stops. Without the grace reaching uvicorn it
    would wait for the stream (>= 20 s) and the server thread would not stop in time."""
    with serve(tools, tiny_llama_dir, grace=1.0) as s:
        s.engine.step_delay = 0.02  # LONG takes >= 20 s
        url = s.srv.base_url + "/v1/completions"
        got: list[dict[str, Any]] = []
        first = threading.Event()

        def stream() -> None:
            with (
                contextlib.suppress(httpx.HTTPError),
                httpx.stream(
                    "POST", url, headers=_auth(), json={**LONG, "stream": True}, timeout=HANG_S
                ) as resp,
            ):
                for event in _events(resp.iter_lines()):
                    got.append(event)
                    first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(HANG_S)
        s.srv.server.should_exit = True  # what SIGTERM does
        reader.join(HANG_S)
        s.srv.thread.join(15)  # 1 s grace plus a loaded machine's slack, far below 20 s
        assert not s.srv.thread.is_alive(), "the server did not stop after its grace"
    assert got and len(got) < LONG["max_tokens"]  # cut, not run to the end
    assert all(e["choices"][0]["finish_reason"] is None for e in got)
    assert not s.async_engine.is_alive()
    stats = s.engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_used"] == 0
    assert stats["kv_free"] + stats["kv_cached"] == stats["kv_total"]
