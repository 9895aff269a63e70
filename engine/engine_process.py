"""The engine in a child process of its own, driven through a pipe (``--engine-process``).

In one process the HTTP side's Python (SSE chunks, socket writes, the streams' wake-ups:
~20 us a streamed token) and the engine loop's take turns on one interpreter lock, so on
a GPU, where a step is mostly host work, served tokens/s falls well below the engine's
own (``python -m bench.http_cost --no-work-model``). SGLang's scheduler and vLLM's
engine core run in processes of their own for this reason. Here the child runs
``Engine.loop`` (plain or overlapped steps) and ``EngineProcess`` stands in for the
``Engine`` in the server's process: ``AsyncEngine`` drives it as it drives an engine in a
thread, so streams, back-pressure and shutdown are the same code either way.

The protocol (pickled tuples; one pipe each way):

- parent -> child: ``("add", prompt_ids, params, request_id)``, ``("abort", request_id)``,
  ``("behind", request_id, flag)``, ``("flush", seq)``, ``("stop",)``.
- child -> parent: ``("ready", info)`` or ``("failed", error)`` once; then
  ``("out", outputs, stats)`` after every step that had outputs (an abort's final output
  too; ``stats`` None where they were sent less than STATS_EVERY_S ago and no request
  ended), ``("stats", stats)`` otherwise, at most as often and when they changed,
  ``("reply", seq, value, stats)`` for a flush, ``("fatal", error)`` (a tensor-parallel
  rank died).

Outputs travel without ``prompt_token_ids`` (the parent has every prompt it sent), and
most of them as three fields only (engine/output_wire.py). A request the child refuses
(queue full, duplicate id) comes back as a finished output carrying the error, which the
stream raises, as the in-thread engine's refusal does.
A parent reader thread takes every message off the pipe at once, so the child never
blocks on a full pipe while the parent sends it a long prompt. The child ignores SIGINT
(the server stops it), and ends when the parent's end of the pipe closes.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import queue
import threading
from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig
from engine.engine_core import IDLE_WAIT_S, EngineInfo, child_main
from engine.errors import EngineDeadError
from engine.output_wire import OutputDecoder
from engine.platform import DeviceSpec
from engine.request import RequestOutput, SamplingParams
from engine.request_checks import check_request

logger = logging.getLogger("hiserve.engine")

READY_POLL_S = 1.0


class EngineProcess:
    """The server-side stand-in for an ``Engine`` that runs in a child process.

    Every method but ``wake``, ``failure`` and ``close`` is called on AsyncEngine's loop
    thread, which also alone reads the inbox the reader thread fills."""

    aborts_later = True  # abort() returns None; the final output comes through step()
    # This process never touches the device (the child owns it): the loop thread's
    # set_device is a no-op.
    device_spec = DeviceSpec("cpu")

    def __init__(self, config: EngineConfig) -> None:
        context = multiprocessing.get_context("spawn")  # CUDA/MUSA cannot be forked
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=child_main,
            args=(config, child_conn, logging.getLogger().level),
            name="hiserve-engine-core",
            daemon=False,  # a daemon cannot start tensor-parallel ranks
        )
        self._process.start()
        child_conn.close()
        # NOTE: multiprocessing joins a non-daemon child at exit, and this one runs until
        # told to stop: an engine never closed (a server stopped while it loaded) would
        # hang the exit. Registered after multiprocessing's own hook, so it runs first.
        atexit.register(self.close)
        try:
            info = self._wait_ready()
        except BaseException:
            self.close()
            raise
        self.config = info.config
        self.tokenizer = info.tokenizer
        self.model_path = info.model_path
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.served_model_name = info.served_model_name
        self._kv_capacity = info.kv_capacity
        self._health = {**info.health, "engine_process": True}
        self._stats = info.stats
        self._inbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._prompts: dict[str, list[int]] = {}  # requests in the child, by id
        self._decoder = OutputDecoder(self._prompts)
        self._ready: list[RequestOutput] = []  # received while waiting for a reply
        self._replies: dict[int, Any] = {}
        self._seq = 0
        self._closing = False
        self._failure: BaseException | None = None
        self._on_fatal: list[Callable[[BaseException], None]] = []
        self._reader = threading.Thread(target=self._read, name="hiserve-engine-pipe", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> EngineInfo:
        while not self._conn.poll(READY_POLL_S):
            if not self._process.is_alive():
                raise RuntimeError(
                    f"the engine process exited with code {self._process.exitcode} while "
                    "loading (its log is above)"
                )
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self._process.join(5.0)
            raise RuntimeError(
                f"the engine process exited with code {self._process.exitcode} while loading"
            ) from None
        if kind == "failed":
            raise value
        return value  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ reader thread
    def _read(self) -> None:
        try:
            while True:
                self._inbox.put(self._conn.recv())
        except (EOFError, OSError):
            if not self._closing:
                self._process.join(5.0)
                code = self._process.exitcode
                self._fail(EngineDeadError(f"the engine process ended (exit code {code})"))
            self._inbox.put(None)

    def _fail(self, error: BaseException) -> None:
        if self._failure is not None:
            return
        self._failure = error
        logger.error("%s", error)
        for callback in self._on_fatal:
            callback(error)

    # ------------------------------------------------------------------ Engine surface
    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def watch_fatal(self, callback: Callable[[BaseException], None]) -> None:
        self._on_fatal.append(callback)

    def wake(self) -> None:
        """Make a waiting ``step`` return, so the loop thread runs new commands."""
        self._inbox.put(None)

    def prepare_grammar(self) -> bool:
        return True  # the child prepared its grammar backend before it said ready

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        check_request(
            prompt_ids,
            params,
            self.config,
            self.vocab_size,
            self.max_model_len,
            self._kv_capacity,
        )

    def enqueue(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> str:
        self._prompts[request_id] = prompt_ids
        self._send(("add", prompt_ids, params, request_id))
        return request_id

    def abort(self, request_id: str) -> None:
        if request_id in self._prompts and self._failure is None:
            self._send(("abort", request_id))

    def set_reader_behind(self, request_id: str, behind: bool) -> None:
        self._send(("behind", request_id, behind))

    def flush_cache(self) -> bool:
        self._seq += 1
        seq = self._seq
        self._send(("flush", seq))
        while seq not in self._replies:
            self._take(block=True)
        return bool(self._replies.pop(seq))

    def stats(self) -> dict[str, float]:
        return self._stats

    def health(self) -> dict[str, object]:
        return dict(self._health)

    @property
    def has_work(self) -> bool:
        return bool(self._prompts or self._ready)

    def step(self) -> list[RequestOutput]:
        """The outputs the child sent since the last call; waits up to IDLE_WAIT_S for
        some (or a ``wake``)."""
        if not self._ready:
            self._take(block=True)
        while self._take(block=False):
            pass
        ready, self._ready = self._ready, []
        return ready

    def close(self) -> None:
        atexit.unregister(self.close)
        self._closing = True
        if self._process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(("stop",))
            self._process.join(30.0)
            if self._process.is_alive():
                logger.warning("the engine process did not stop within 30 s; killing it")
                self._process.kill()
                self._process.join(5.0)
        self._conn.close()

    # ------------------------------------------------------------------ internals
    def _send(self, message: tuple[Any, ...]) -> None:
        if self._failure is not None:
            raise self._failure
        try:
            self._conn.send(message)
        except OSError as exc:
            raise EngineDeadError(f"the engine process is gone: {exc}") from exc

    def _take(self, block: bool) -> bool:
        """Handle one message from the inbox; False if there was none (or only a wake)."""
        try:
            message = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return False
        if message is None:
            if self._failure is not None:
                raise self._failure
            return False
        kind = message[0]
        if kind == "out":
            self._ready += self._decoder.decode(message[1])
            if message[2] is not None:
                self._stats = message[2]
        elif kind == "stats":
            self._stats = message[1]
        elif kind == "reply":
            self._replies[message[1]] = message[2]
            self._stats = message[3]
        elif kind == "fatal":
            self._fail(message[1])
        return True
