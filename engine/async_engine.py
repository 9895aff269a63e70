"""Runs the engine loop in its own thread and streams outputs to asyncio callers."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import RequestOutput, SamplingParams
from engine.scheduler import QueueFullError

logger = logging.getLogger("hiserve.engine")


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    """Thread-safe front of an ``Engine``: HTTP work never blocks the loop and vice versa.

    All engine state is touched by the loop thread only; other threads talk to it through
    ``_inbox`` (commands) and per-request asyncio queues (outputs).
    """

    def __init__(self, config: EngineConfig, engine: Engine | None = None) -> None:
        self.engine = engine or Engine(config)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.model_path = self.engine.model_path
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.vocab_size
        self.served_model_name = self.engine.served_model_name
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = True
        self._error: BaseException | None = None
        self._stats: dict[str, float] = self.engine.stats()
        self._health: dict[str, object] = self.engine.health()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hiserve-engine", daemon=True)
            self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish for ``grace_s``, abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while self._streams and time.monotonic() < deadline and self.is_alive():
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
        self.engine.close()

    # ------------------------------------------------------------------ loop thread
    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._drain_inbox()
                if not engine.has_work:
                    self._stats = engine.stats()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                outputs = engine.step()
                self._stats = engine.stats()
                if outputs:
                    self._deliver(outputs)
            # NOTE: commands queued before the stop still run (shutdown's aborts of the
            # requests that outlived the grace), and any stream left gets a final
            # output: no caller waits forever on a loop that is gone.
            self._drain_inbox()
            for request_id, stream in list(self._streams.items()):
                del self._streams[request_id]
                out = engine.abort(request_id)
                final: RequestOutput | BaseException = (
                    out if out is not None else EngineDeadError("the engine stopped")
                )
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, final)
        except BaseException as exc:  # the loop must never die silently
            logger.exception("engine loop crashed")
            self._error = exc
            for stream in list(self._streams.values()):
                stream.loop.call_soon_threadsafe(
                    stream.queue.put_nowait, EngineDeadError(f"engine loop crashed: {exc}")
                )

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            command()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            # One hop per event loop per step, not one per token.
            loop.call_soon_threadsafe(_put_all, items)

    def _submit(self, command: Callable[[], None]) -> None:
        if not self.is_alive():
            raise EngineDeadError("the engine loop is not running")
        self._inbox.put(command)
        self._wake.set()

    # ------------------------------------------------------------------ public API
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_ids, params)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yield snapshots of ``request_id`` until it finishes; closing the iterator aborts."""
        if not self._accepting:
            raise EngineOverloadedError("server is shutting down")
        self.validate(prompt_ids, params)
        waiting = self._stats.get("waiting", 0)
        if waiting >= self.config.max_waiting_requests:
            raise EngineOverloadedError(
                f"server overloaded: {int(waiting)} requests waiting; retry later"
            )
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())

        def add() -> None:
            if request_id in self._streams:
                stream.loop.call_soon_threadsafe(
                    stream.queue.put_nowait, ValueError(f"duplicate request id {request_id!r}")
                )
                return
            try:
                self.engine.add_request(prompt_ids, params, request_id)
            except (QueueFullError, ValueError) as exc:
                error: BaseException = (
                    EngineOverloadedError(str(exc)) if isinstance(exc, QueueFullError) else exc
                )
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
                return
            self._streams[request_id] = stream

        self._submit(add)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        def do_abort() -> None:
            out = self.engine.abort(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None and out is not None:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

        if self.is_alive():
            self._submit(do_abort)

    async def flush_cache(self) -> bool:
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        loop = future.get_loop()

        def flush() -> None:
            result = self.engine.flush_cache()
            loop.call_soon_threadsafe(future.set_result, result)

        self._submit(flush)
        return await future

    def stats(self) -> dict[str, float]:
        """Latest numbers published by the loop (read without locking the engine)."""
        return dict(self._stats)

    def health(self) -> dict[str, Any]:
        return dict(self._health)


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)
