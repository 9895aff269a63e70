"""--engine-process: the engine in a child process, driven by AsyncEngine through
EngineProcess. Compared with the same engine in a thread (the same outputs, output for
output), and its ways to end: an abort frees the KV, a refused request raises, a child
that dies fails its streams and calls the fatal callback, shutdown ends the child, a
model that does not load raises in the server's process. The protocol's refusal and
replies are checked against a fake engine over a pipe in this process."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from multiprocessing import Pipe
from pathlib import Path
from typing import Any

import pytest

from engine import EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from engine.engine_core import ChildSender, portable_error, refused, serve
from engine.engine_process import EngineProcess
from engine.errors import InvalidRequestError
from engine.model_files import ModelPathError
from engine.platform import DeviceSpec
from engine.request import RequestOutput, TokenLogprob
from engine.scheduler import QueueFullError
from tests.unit.test_async_engine import wait_for

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8, 12, 13], [20] * 9]
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=9, temperature=0.8, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=15, temperature=0, stop=["a"]),
    SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stream=False),
]


def config_of(model_dir: Path, **overrides: Any) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), device="cpu", dtype="float32", kv_cache_tokens=4096, **overrides
    )


def start(config: EngineConfig) -> AsyncEngine:
    async_engine = AsyncEngine(config, EngineProcess(config))
    async_engine.start()
    return async_engine


def stop(async_engine: AsyncEngine) -> None:
    asyncio.run(async_engine.shutdown(5.0))


@pytest.fixture(scope="module")
def in_process(tiny_llama_dir: Path) -> Iterator[AsyncEngine]:
    async_engine = start(config_of(tiny_llama_dir))
    yield async_engine
    stop(async_engine)


async def collect(async_engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams):  # type: ignore[no-untyped-def]
    return [out async for out in async_engine.generate(prompt, params, rid)]


def run_all(async_engine: AsyncEngine) -> list[list[RequestOutput]]:
    async def go() -> list[list[RequestOutput]]:
        runs = [
            collect(async_engine, f"r{i}", prompt, params)
            for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True))
        ]
        return list(await asyncio.gather(*runs))

    return asyncio.run(go())


def same_logprobs(got: list[TokenLogprob] | None, want: list[TokenLogprob] | None) -> None:
    assert (got is None) == (want is None)
    for a, b in zip(got or [], want or [], strict=True):
        assert a.token_id == b.token_id and a.top.keys() == b.top.keys()
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert list(a.top.values()) == pytest.approx(list(b.top.values()), abs=1e-4)


def test_outputs_are_those_of_the_engine_in_a_thread(
    in_process: AsyncEngine, tiny_llama_dir: Path
) -> None:
    threaded = AsyncEngine(config_of(tiny_llama_dir))
    assert threaded.health()["engine_process"] is False
    assert in_process.health()["engine_process"] is True
    threaded.start()
    try:
        expected = run_all(threaded)
    finally:
        stop(threaded)
    got = run_all(in_process)
    assert [len(outs) for outs in got] == [len(outs) for outs in expected]
    assert len(got[3]) == 2  # not streamed: its first token and the end
    for outs, want in zip(got, expected, strict=True):
        for out, ref in zip(outs, want, strict=True):
            # Timings and cache hits differ between two engines; the rest is the same.
            for field in ("first_token_time", "arrival_time", "cached_tokens"):
                setattr(out, field, getattr(ref, field))
            out.cached_tokens_device = ref.cached_tokens_device
            out.cache_miss_reasons = ref.cache_miss_reasons
            # Logprobs to float32 noise: which requests share a step differs.
            for field in ("logprobs", "new_logprobs"):
                same_logprobs(getattr(out, field), getattr(ref, field))
                setattr(out, field, getattr(ref, field))
            assert out == ref
        assert outs[-1].prompt_token_ids == PROMPTS[got.index(outs)]


def test_an_abort_ends_the_request_and_frees_its_kv(in_process: AsyncEngine) -> None:
    async def go() -> None:
        params = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
        gen = in_process.generate([5, 6, 7], params, "long")
        await gen.__anext__()
        await gen.__anext__()
        await wait_for(lambda: in_process.stats()["running"] == 1)  # sent every 50 ms
        await gen.aclose()  # the reader is gone: the request is aborted
        await wait_for(lambda: in_process.stats()["running"] == 0)
        assert in_process.stats()["kv_used"] == 0

    asyncio.run(go())
    assert not in_process.engine.has_work  # no request left on this side either


def test_a_bad_request_is_refused_at_the_call(in_process: AsyncEngine) -> None:
    vocab = in_process.vocab_size
    with pytest.raises(InvalidRequestError) as refused:
        in_process.generate([vocab + 5], SamplingParams(max_tokens=4), "bad")
    assert refused.value.param == "prompt"


def test_flush_cache_runs_in_the_child(in_process: AsyncEngine) -> None:
    run_all(in_process)

    async def go() -> None:
        # AsyncEngine publishes the stats its loop thread last took (every 50 ms at most).
        await wait_for(lambda: in_process.stats()["kv_cached"] > 0)
        assert await in_process.flush_cache() is True
        await wait_for(lambda: in_process.stats()["kv_cached"] == 0)

    asyncio.run(go())


def test_a_dead_engine_process_fails_streams_and_calls_the_fatal_callback(
    tiny_llama_dir: Path,
) -> None:
    async_engine = start(config_of(tiny_llama_dir))
    fatal: list[BaseException] = []
    called = threading.Event()
    async_engine.watch_fatal(lambda exc: (fatal.append(exc), called.set()))
    process = async_engine.engine._process  # type: ignore[union-attr]

    async def go() -> None:
        params = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
        gen = async_engine.generate([5, 6, 7], params, "doomed")
        await gen.__anext__()
        os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass

    try:
        asyncio.run(go())
        assert called.wait(10.0)
        assert isinstance(fatal[0], EngineDeadError) and "exit code -9" in str(fatal[0])
        assert not async_engine.is_alive()
        after = async_engine.generate([5], SamplingParams(max_tokens=2), "after")
        with pytest.raises(EngineDeadError):
            asyncio.run(after.__anext__())
    finally:
        stop(async_engine)


def test_shutdown_ends_the_engine_process(tiny_llama_dir: Path) -> None:
    async_engine = start(config_of(tiny_llama_dir))
    process = async_engine.engine._process  # type: ignore[union-attr]
    outs = run_all(async_engine)
    assert all(o[-1].finished for o in outs)
    stop(async_engine)
    assert process.exitcode == 0


def test_shutdown_ends_a_request_past_the_grace_with_its_abort_output(
    tiny_llama_dir: Path,
) -> None:
    async_engine = start(config_of(tiny_llama_dir))

    async def go() -> RequestOutput:
        params = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)
        gen = async_engine.generate([5, 6, 7], params, "endless")
        await gen.__anext__()
        await async_engine.shutdown(0.1)
        outs = [out async for out in gen]  # no EngineDeadError: the child's abort output
        return outs[-1]

    last = asyncio.run(go())
    assert last.finished and last.finish_reason == "abort" and 0 < len(last.token_ids) < 3000


def test_an_engine_process_never_closed_does_not_hang_the_exit(tiny_llama_dir: Path) -> None:
    """A server stopped while its model loads drops the engine unclosed: multiprocessing
    would join the child for ever at exit, but the engine process is stopped first."""
    script = (
        "from engine import EngineConfig\n"
        "from engine.engine_process import EngineProcess\n"
        "if __name__ == '__main__':\n"
        f"    engine = EngineProcess(EngineConfig(model={str(tiny_llama_dir)!r}, device='cpu',"
        " kv_cache_tokens=1024))\n"
        "    print(engine._process.pid, flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    child = int(done.stdout.split()[-1])
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # gone with its parent


def test_a_model_that_does_not_load_raises_here(tmp_path: Path) -> None:
    before = {c.pid for c in multiprocessing.active_children()}
    with pytest.raises(ModelPathError, match="not-a-model"):
        EngineProcess(config_of(tmp_path / "not-a-model"))
    assert {c.pid for c in multiprocessing.active_children()} <= before  # none left


def test_an_error_that_does_not_pickle_arrives_as_its_text() -> None:
    class Odd(RuntimeError):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(f"{a}/{b}")

    class OddValue(ValueError):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(f"{a}/{b}")

    assert isinstance(portable_error(Odd(1, 2)), RuntimeError)
    assert str(portable_error(Odd(1, 2))) == "Odd: 1/2"
    assert type(portable_error(OddValue(1, 2))) is ValueError  # still the request's fault
    plain = InvalidRequestError("bad", param="stop")
    assert portable_error(plain) is plain


class FakeEngine:
    """The surface ``serve`` drives: nothing to step, a queue that is full for "full"."""

    device_spec = DeviceSpec("cpu")

    def __init__(self) -> None:
        self.loop = self
        self.has_work = False
        self.added: list[str] = []
        self.behind: list[tuple[str, bool]] = []

    def enqueue(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> str:
        if request_id == "full":
            raise QueueFullError("too many requests waiting")
        if request_id == "dup":
            raise ValueError("request id 'dup' is already in use")
        self.added.append(request_id)
        return request_id

    def abort(self, request_id: str) -> None:
        return None

    def set_reader_behind(self, request_id: str, behind: bool) -> None:
        self.behind.append((request_id, behind))

    def flush_cache(self) -> bool:
        return True

    def stats(self) -> dict[str, float]:
        return {"waiting": float(len(self.added))}


def next_message(conn: Any) -> tuple[Any, ...]:
    """The next message that is not an idle tick's stats."""
    message = conn.recv()
    while message[0] == "stats":
        message = conn.recv()
    return message  # type: ignore[no-any-return]


def test_the_child_loop_refuses_replies_and_stops() -> None:
    parent, child = Pipe()
    engine = FakeEngine()
    loop = threading.Thread(target=serve, args=(engine, child, ChildSender(child)))
    loop.start()
    try:
        parent.send(("add", [1, 2], SamplingParams(), "ok"))
        parent.send(("add", [1, 2], SamplingParams(), "full"))
        kind, outs, stats = next_message(parent)
        assert kind == "out" and stats == {"waiting": 1.0}
        assert outs[0].request_id == "full" and outs[0].finished
        assert isinstance(outs[0].error, EngineOverloadedError)
        parent.send(("add", [1], SamplingParams(), "dup"))
        kind, outs, _ = next_message(parent)
        assert type(outs[0].error) is ValueError and "already in use" in str(outs[0].error)
        parent.send(("behind", "ok", True))
        parent.send(("flush", 3))
        assert next_message(parent) == ("reply", 3, True, {"waiting": 1.0})
        assert engine.behind == [("ok", True)] and engine.added == ["ok"]
        parent.send(("stop",))
        loop.join(5.0)
        assert not loop.is_alive()
    finally:
        parent.close()
        loop.join(5.0)


class BusyFakeEngine(FakeEngine):
    """Always has work; every step outputs one token of request "a"."""

    def __init__(self) -> None:
        super().__init__()
        self.has_work = True

    def step(self) -> list[RequestOutput]:
        out = refused("a", RuntimeError("unused"))
        out.finished, out.error, out.new_token_ids = False, None, [7]
        return [out]


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "stepping"])
def test_the_child_loop_ends_when_the_server_is_gone(busy: bool) -> None:
    parent, child = Pipe()
    engine = BusyFakeEngine() if busy else FakeEngine()
    loop = threading.Thread(target=serve, args=(engine, child, ChildSender(child)))
    loop.start()
    if busy:
        assert parent.recv()[0] == "out"  # it steps and sends
    parent.close()
    loop.join(10.0)
    assert not loop.is_alive()
