"""Runs the engine loop in its own thread and streams outputs to asyncio callers."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from engine import platform
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import EngineDeadError, EngineOverloadedError, StreamStalledError
from engine.output_streams import OutputChannel, Stream, merge_outputs, put_all
from engine.request import RequestOutput, SamplingParams
from engine.scheduler import QueueFullError

if TYPE_CHECKING:
    from engine.engine_process import EngineProcess

__all__ = ["AsyncEngine", "EngineDeadError", "EngineOverloadedError", "StreamStalledError"]

logger = logging.getLogger("hiserve.engine")

ABORTS_WAIT_S = 5.0  # the wait for an engine process's abort outputs at shutdown


class AsyncEngine:
    """Thread-safe front of an ``Engine``: HTTP work never blocks the loop and vice versa.

    All engine state is touched by the loop thread only; other threads talk to it through
    ``_inbox`` (commands) and per-request asyncio queues (outputs).
    """

    def __init__(self, config: EngineConfig, engine: Engine | EngineProcess | None = None) -> None:
        # An EngineProcess stands in for an engine that runs in a child process
        # (--engine-process): the same surface, its outputs arriving through step().
        self.engine = engine or Engine(config)
        # An engine in another process: its abort outputs come back as a step's, and a
        # loop thread waiting inside its step() is woken through it.
        self._aborts_later = bool(getattr(self.engine, "aborts_later", False))
        self._engine_wake: Callable[[], None] | None = getattr(self.engine, "wake", None)
        self.engine.prepare_grammar()  # here, in the loading thread, not on the loop
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.model_path = self.engine.model_path
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.vocab_size
        self.served_model_name = self.engine.served_model_name
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, Stream] = {}
        # Streams whose reader is behind: request id -> stream (loop thread only).
        self._backlog: dict[str, Stream] = {}
        # Requests paused for their reader (Req.reader_behind), until it has taken half of
        # its queue: request id -> stream (loop thread only).
        self._paused: dict[str, Stream] = {}
        self._thread: threading.Thread | None = None
        self.join_timeout_s = 10.0
        self._close_lock = threading.Lock()
        self._closed = False
        self._stopping = False
        self._accepting = True
        self._error: BaseException | None = None
        self._stats: dict[str, float] = self.engine.stats()
        # Where the engine runs: an EngineProcess's health says True.
        self._health: dict[str, object] = {"engine_process": False, **self.engine.health()}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hiserve-engine", daemon=True)
            self._thread.start()

    def is_alive(self) -> bool:
        return (
            self._thread is not None
            and self._thread.is_alive()
            and self._error is None
            and getattr(self.engine, "failure", None) is None  # e.g. a dead TP rank
        )

    def watch_fatal(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)``, from another thread, when the engine can no longer run
        (a tensor-parallel rank died): the server then exits non-zero."""
        watch = getattr(self.engine, "watch_fatal", None)
        if watch is not None:
            watch(callback)

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
            await asyncio.to_thread(self._thread.join, self.join_timeout_s)
            if self._thread.is_alive():
                # NOTE: never release host memory under a running loop: its copies may
                # still read or write it. The loop closes the engine when it ends.
                logger.warning(
                    "engine loop still running %.0f s after shutdown; it releases the "
                    "engine when its current step ends",
                    self.join_timeout_s,
                )
                return
        self._close_engine()

    def _close_engine(self) -> None:
        """Close the engine once, from whichever of shutdown() and the loop ends last."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.engine.close()

    # ------------------------------------------------------------------ loop thread
    def _loop(self) -> None:
        engine = self.engine
        # Engine.loop: overlapped steps or engine.step() itself (a test's fake has none).
        driver = getattr(engine, "loop", engine)
        try:
            # A new thread starts on device 0: calls that take no device mean this one.
            platform.set_device(engine.device_spec)
            while not self._stopping:
                self._drain_inbox()
                if self._backlog:
                    self._flush_backlog()
                if self._paused:
                    self._resume_caught_up()
                if not driver.has_work:
                    self._stats = engine.stats()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                outputs = driver.step()
                self._stats = engine.stats()
                if outputs:
                    self._deliver(outputs)
            # NOTE: commands queued before the stop still run (shutdown's aborts of the
            # requests that outlived the grace), and any stream left gets a final
            # output: no caller waits forever on a loop that is gone.
            self._drain_inbox()
            if self._aborts_later:
                self._await_aborts(driver)
            # A reader that was behind still gets what was held back for it (the loop
            # that would have handed it over is ending), then its final output.
            for stream in self._backlog.values():
                if stream.pending is not None:
                    stream.put(stream.pending)
                    stream.pending = None
            self._backlog.clear()
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
        finally:
            if self._stopping:
                self._close_engine()

    def _await_aborts(self, driver: Any) -> None:
        """Deliver the final outputs of shutdown's aborts from an engine in another
        process (they come as a step's), for at most ABORTS_WAIT_S."""
        deadline = time.monotonic() + ABORTS_WAIT_S
        while self._streams and driver.has_work and time.monotonic() < deadline:
            outputs = driver.step()
            if outputs:
                self._deliver(outputs)

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            command()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, RequestOutput]]] = {}
        limit = self.config.max_queued_outputs
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            if stream.pending is not None or stream.sent - stream.taken >= limit:
                # The reader is behind: hold one merged delta instead of queueing more.
                pending = stream.pending
                stream.pending = out if pending is None else merge_outputs(pending, out)
                self._backlog[out.request_id] = stream
                if not out.finished and out.request_id not in self._paused:
                    self._set_reader_behind(out.request_id, True)
                    self._paused[out.request_id] = stream
                continue
            stream.sent += 1
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            # One hop per event loop per step, not one per token.
            loop.call_soon_threadsafe(put_all, items)

    def _set_reader_behind(self, request_id: str, behind: bool) -> None:
        setter = getattr(self.engine, "set_reader_behind", None)  # a test's fake has none
        if setter is not None:
            setter(request_id, behind)

    def _resume_caught_up(self) -> None:
        """Let paused requests go on once their reader has taken half of its queue (not
        at once: a reader slower than the engine would pause it every step)."""
        limit = self.config.max_queued_outputs
        for request_id, stream in list(self._paused.items()):
            if self._streams.get(request_id) is not stream:
                del self._paused[request_id]  # ended meanwhile
            elif stream.pending is None and stream.sent - stream.taken <= limit // 2:
                del self._paused[request_id]
                self._set_reader_behind(request_id, False)

    def _flush_backlog(self) -> None:
        """Hand held-back outputs to readers that caught up; end the requests of readers
        that took nothing for ``stream_stall_timeout`` seconds (their KV is freed)."""
        now = time.monotonic()
        limit = self.config.max_queued_outputs
        for request_id, stream in list(self._backlog.items()):
            if stream.pending is not None and stream.sent - stream.taken < limit:
                stream.put(stream.pending)
                stream.pending = None
            # NOTE: a request paused for its reader stays here after its held delta went
            # out: a reader that then takes nothing more stalls with nothing held back.
            paused = request_id in self._paused and self._streams.get(request_id) is stream
            if stream.pending is None and not paused:
                del self._backlog[request_id]
            elif (
                stream.sent > stream.taken
                and now - stream.last_read > self.config.stream_stall_timeout
            ):
                stream.pending = None
                del self._backlog[request_id]
                self._streams.pop(request_id, None)
                ended = self.engine.abort(request_id)
                if ended is not None or self._aborts_later:
                    logger.warning(
                        "request %s ended: its reader took nothing for %.0f s",
                        request_id,
                        self.config.stream_stall_timeout,
                    )
                stream.put(
                    StreamStalledError(
                        f"the stream was not read for {self.config.stream_stall_timeout:.0f} s "
                        "(--stream-stall-timeout); the request was ended"
                    )
                )

    def _submit(self, command: Callable[[], None]) -> None:
        if not self.is_alive():
            raise EngineDeadError("the engine loop is not running")
        self._inbox.put(command)
        self._notify()

    def _notify(self) -> None:
        """Wake the loop thread, also where it waits inside an engine in another process."""
        self._wake.set()
        if self._engine_wake is not None:
            self._engine_wake()

    # ------------------------------------------------------------------ public API
    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Snapshots of ``request_id`` until it finishes; closing the iterator aborts.

        NOTE: the request is validated here, once, on the caller's thread: a bad field
        raises InvalidRequestError (naming it) at this call, before anything is queued,
        and the loop thread enqueues the request without checking it again. A full queue
        is refused here too, at once, from the last step's count (the loop thread may be
        inside a long step); the scheduler's own bound stays the exact one.
        """
        if not self._accepting:
            raise EngineOverloadedError("server is shutting down")
        self.engine.validate(prompt_ids, params)
        waiting = self._stats.get("waiting", 0)
        if waiting >= self.config.max_waiting_requests:
            raise EngineOverloadedError(
                f"server overloaded: {int(waiting)} requests waiting; retry later"
            )
        return self._stream(prompt_ids, params, request_id)

    async def _stream(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        stream = Stream(loop, OutputChannel(loop))

        def add() -> None:
            if request_id in self._streams:
                stream.loop.call_soon_threadsafe(
                    stream.queue.put_nowait, ValueError(f"duplicate request id {request_id!r}")
                )
                return
            try:
                self.engine.enqueue(prompt_ids, params, request_id)
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
                stream.taken += 1
                stream.last_read = time.monotonic()
                if stream.pending is not None:
                    self._notify()  # the held-back output may go out now
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                if finished and item.error is not None:
                    raise item.error  # e.g. a constraint that did not compile in time
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        def do_abort() -> None:
            out = self.engine.abort(request_id)
            if self._aborts_later:
                return  # an engine in another process: its final output comes as a step's
            stream = self._streams.pop(request_id, None)
            self._backlog.pop(request_id, None)
            if stream is not None and out is not None:
                if stream.pending is not None:  # a reader behind: the deltas it was owed too
                    out = merge_outputs(stream.pending, out)
                    stream.pending = None
                stream.put(out)

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
