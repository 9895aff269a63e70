"""AsyncEngine, the real loop thread over a real Engine (tiny random model): shutdown
grace, the two overload sources, and a loop crash reaching streams already running.

Synchronisation is by events and by polling published state, never by sleeping; the
only waits with a clock are pacing (a slowed step) and timeouts that turn a hang into a
failure.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from engine import EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from engine.errors import InvalidRequestError
from engine.request import RequestOutput
from tests.unit.stepped_engine import HANG_S, SteppedEngine

LONG = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)


def make_async(model_dir: Path, **overrides: Any) -> tuple[AsyncEngine, SteppedEngine]:
    config = EngineConfig(
        model=str(model_dir), device="cpu", dtype="float32", kv_cache_tokens=4096, **overrides
    )
    engine = SteppedEngine(config)
    async_engine = AsyncEngine(config, engine=engine)
    async_engine.start()
    return async_engine, engine


async def wait_for(predicate: Callable[[], bool], timeout: float = HANG_S) -> None:
    """Poll ``predicate`` (published state) without blocking the event loop."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never became true"
        await asyncio.sleep(0.01)


async def last_output(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for out in gen:
        last = out
    assert last is not None
    return last


def test_shutdown_lets_a_request_finish_within_the_grace(tiny_llama_dir: Path) -> None:
    async_engine, _ = make_async(tiny_llama_dir)

    async def run() -> RequestOutput:
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        gen = async_engine.generate([5, 6, 7], params, "r0")
        first = await gen.__anext__()
        assert not first.finished
        rest = asyncio.ensure_future(last_output(gen))
        await asyncio.wait_for(async_engine.shutdown(grace_s=HANG_S), HANG_S)
        return await asyncio.wait_for(rest, HANG_S)

    final = asyncio.run(run())
    assert final.finish_reason == "length" and len(final.token_ids) == 24  # not cut
    assert not async_engine.is_alive()


def test_shutdown_aborts_what_outlives_the_grace(tiny_llama_dir: Path) -> None:
    async_engine, engine = make_async(tiny_llama_dir)
    engine.step_delay = 0.02  # LONG takes >= 20 s; the grace is 0.3 s

    async def run() -> tuple[RequestOutput, float]:
        gen = async_engine.generate([5, 6, 7], LONG, "straggler")
        await gen.__anext__()
        rest = asyncio.ensure_future(last_output(gen))
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(async_engine.shutdown(grace_s=0.3), HANG_S)
        took = loop.time() - started
        return await asyncio.wait_for(rest, HANG_S), took

    final, took = asyncio.run(run())
    assert final.finish_reason == "abort" and len(final.token_ids) < LONG.max_tokens
    assert 0.3 <= took < 15  # waited the grace, then stopped (loose: a loaded 2-core box)
    assert not async_engine.is_alive()
    stats = engine.stats()
    assert stats["running"] == 0 and stats["kv_used"] == 0  # the abort released its KV
    with pytest.raises(EngineOverloadedError, match="shutting down"):
        asyncio.run(async_engine.generate([5], LONG, "late").__anext__())


def test_full_waiting_queue_is_refused_before_reaching_the_loop(tiny_llama_dir: Path) -> None:
    async_engine, engine = make_async(
        tiny_llama_dir, max_running_requests=1, max_waiting_requests=1
    )
    engine.step_delay = 0.01

    async def run() -> None:
        running = async_engine.generate([5, 6, 7], LONG, "running")
        await running.__anext__()
        waiting = async_engine.generate([8, 9], LONG, "waiting")
        waiter = asyncio.ensure_future(waiting.__anext__())
        await wait_for(lambda: async_engine.stats()["waiting"] == 1)
        with pytest.raises(EngineOverloadedError, match="1 requests waiting; retry later"):
            await async_engine.generate([10, 11], LONG, "refused").__anext__()
        assert "refused" not in engine.added  # answered without a round trip to the loop
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        await waiting.aclose()
        await running.aclose()
        await async_engine.shutdown(grace_s=0)

    asyncio.run(run())


def test_queue_full_in_the_scheduler_becomes_overloaded(tiny_llama_dir: Path) -> None:
    """Two requests that pass the published-stats check at once: the scheduler's own limit
    (QueueFullError) refuses the second, and the caller sees EngineOverloadedError."""
    async_engine, engine = make_async(
        tiny_llama_dir, max_running_requests=1, max_waiting_requests=1
    )
    engine.step_delay = 0.01

    async def run() -> None:
        running = async_engine.generate([5, 6, 7], LONG, "running")
        await running.__anext__()
        engine.park.set()  # freeze the loop: the published stats still say 0 waiting
        await wait_for(engine.parked.is_set)
        first = asyncio.ensure_future(async_engine.generate([8, 9], LONG, "first").__anext__())
        second_gen = async_engine.generate([10, 11], LONG, "second")
        second = asyncio.ensure_future(second_gen.__anext__())
        await wait_for(lambda: async_engine._inbox.qsize() == 2)  # both queued for the loop
        engine.resume.set()
        with pytest.raises(EngineOverloadedError, match=r"--max-waiting-requests 1"):
            await asyncio.wait_for(second, HANG_S)
        assert engine.added == ["running", "first"]
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await running.aclose()
        await async_engine.shutdown(grace_s=0)

    asyncio.run(run())


def test_loop_crash_reaches_running_streams(tiny_llama_dir: Path) -> None:
    async_engine, engine = make_async(tiny_llama_dir)

    async def run() -> None:
        gens = [async_engine.generate([5 + i, 6], LONG, f"r{i}") for i in range(2)]
        for gen in gens:
            await gen.__anext__()
        engine.crash = RuntimeError("device lost")
        for gen in gens:
            with pytest.raises(EngineDeadError, match="engine loop crashed: device lost"):
                await asyncio.wait_for(last_output(gen), HANG_S)
        assert not async_engine.is_alive()
        with pytest.raises(EngineDeadError, match="not running"):
            await async_engine.generate([5], LONG, "after").__anext__()

    asyncio.run(run())


def test_a_request_is_validated_once_before_it_is_queued(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AsyncEngine.generate is the engine's one check: at the call, on the caller's thread;
    the loop thread queues the request without checking it again."""
    async_engine, engine = make_async(tiny_llama_dir)
    checked_on: list[str] = []
    real_validate = engine.validate

    def spy(prompt_ids: list[int], params: SamplingParams) -> None:
        checked_on.append(threading.current_thread().name)
        real_validate(prompt_ids, params)

    monkeypatch.setattr(engine, "validate", spy)

    async def run() -> RequestOutput:
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        final = await last_output(async_engine.generate([5, 6, 7], params, "good"))
        with pytest.raises(InvalidRequestError) as refused:
            async_engine.generate([5, 6], SamplingParams(top_p=0.0), "bad")  # at the call
        assert refused.value.param == "top_p"
        await async_engine.shutdown(grace_s=0)
        return final

    final = asyncio.run(run())
    assert len(final.token_ids) == 3
    assert checked_on == [threading.current_thread().name] * 2  # never on the loop thread
    assert engine.added == ["good"]  # the refused request was never queued
