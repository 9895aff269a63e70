"""The engine process's side of ``--engine-process`` (engine/engine_process.py has the
server's side and the protocol): build the engine, say ready, then run the commands the
server sends between steps and send every step's outputs back.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engine import platform
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import EngineOverloadedError
from engine.output_wire import OutputEncoder
from engine.request import FinishReason, RequestOutput
from engine.scheduler import QueueFullError

logger = logging.getLogger("hiserve.engine")

IDLE_WAIT_S = 0.05  # the wait for a command while there is no work (both sides)
STATS_EVERY_S = 0.05  # a step without an ended request sends the stats at most this often
# The server's log lines (server/__main__.py) and so the engine process's.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True)
class EngineInfo:
    """What the server's process needs of the engine the child built."""

    config: EngineConfig
    tokenizer: Any
    model_path: Path
    max_model_len: int
    vocab_size: int
    served_model_name: str
    kv_capacity: int
    health: dict[str, object]
    stats: dict[str, float]


def portable_error(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError with its text (a ValueError
    for a ValueError: that one is the request's fault, and stays so)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        kind = ValueError if isinstance(exc, ValueError) else RuntimeError
        return kind(f"{type(exc).__name__}: {exc}")


def child_main(config: EngineConfig, conn: Connection, log_level: int) -> None:
    """The engine process: build the engine, say ready, then serve commands and steps
    until told to stop or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops this process itself
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    try:
        engine = Engine(config)
        engine.prepare_grammar()
        info = EngineInfo(
            config=engine.config,
            tokenizer=engine.tokenizer,
            model_path=engine.model_path,
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            served_model_name=engine.served_model_name,
            kv_capacity=engine.kv.manager.capacity,
            health=engine.health(),
            stats=engine.stats(),
        )
    except BaseException as exc:
        logger.exception("the engine process could not load the model")
        with contextlib.suppress(OSError):
            conn.send(("failed", portable_error(exc)))
        return
    sender = ChildSender(conn)
    engine.watch_fatal(sender.fatal)
    sender.send(("ready", info))
    try:
        serve(engine, conn, sender)
    finally:
        engine.close()


class ParentGone(Exception):
    """The server's process closed its end of the pipe: the engine process ends."""


class ChildSender:
    """The child's end of the pipe for sending: the loop and a fatal callback's thread
    both send."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.encoder = OutputEncoder()  # used by the loop's thread alone

    def send(self, message: tuple[Any, ...]) -> None:
        try:
            with self.lock:
                self.conn.send(message)
        except OSError as exc:  # EPIPE: nobody reads any more
            raise ParentGone from exc

    def outputs(self, outputs: list[RequestOutput], stats: dict[str, float] | None) -> None:
        for out in outputs:
            if out.error is not None:
                out.error = portable_error(out.error)  # type: ignore[assignment]
        self.send(("out", self.encoder.encode(outputs), stats))

    def fatal(self, exc: BaseException) -> None:
        """Tell the server the engine can no longer run (called from the thread that
        watches the tensor-parallel ranks)."""
        with contextlib.suppress(ParentGone):
            self.send(("fatal", portable_error(exc)))


def serve(engine: Any, conn: Connection, sender: ChildSender) -> None:
    """Run the server's commands between steps; step while there is work; return when
    told to stop or when the server's process is gone."""
    platform.set_device(engine.device_spec)
    driver = engine.loop
    last_stats: dict[str, float] | None = None
    sent_at = 0.0
    try:
        while True:
            if conn.poll(0 if driver.has_work else IDLE_WAIT_S) and not run_commands(
                engine, conn, sender
            ):
                return
            if driver.has_work:
                outputs = driver.step()
                if outputs:
                    # The stats at most every STATS_EVERY_S (80-odd numbers to pickle),
                    # and whenever a request ends (a caller may read them right after).
                    now = time.monotonic()
                    stats = None
                    if now - sent_at >= STATS_EVERY_S or any(out.finished for out in outputs):
                        stats = last_stats = engine.stats()
                        sent_at = now
                    sender.outputs(outputs, stats)
                    continue
            now = time.monotonic()
            if now - sent_at >= STATS_EVERY_S:
                sent_at = now
                stats = engine.stats()
                if stats != last_stats:
                    last_stats = stats
                    sender.send(("stats", stats))
    except ParentGone:
        logger.warning("the server's process is gone; the engine process ends")


def run_commands(engine: Any, conn: Connection, sender: ChildSender) -> bool:
    """Run every command waiting on the pipe; False once told to stop."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError) as exc:
            raise ParentGone from exc
        kind = message[0]
        if kind == "stop":
            return False
        if kind == "add":
            _, prompt_ids, params, request_id = message
            try:
                engine.enqueue(prompt_ids, params, request_id)
            except (QueueFullError, ValueError) as exc:
                error = EngineOverloadedError(str(exc)) if isinstance(exc, QueueFullError) else exc
                sender.outputs([refused(request_id, error)], engine.stats())
        elif kind == "abort":
            out = engine.abort(message[1])
            if out is not None:
                sender.outputs([out], engine.stats())
        elif kind == "behind":
            engine.set_reader_behind(message[1], message[2])
        elif kind == "flush":
            flushed = engine.flush_cache()
            sender.send(("reply", message[1], flushed, engine.stats()))
        if not conn.poll(0):
            return True


def refused(request_id: str, error: BaseException) -> RequestOutput:
    """The final output of a request the engine would not queue: it carries the error."""
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=[],
        token_ids=[],
        text="",
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason=FinishReason.ABORT.value,
        cached_tokens=0,
        cached_tokens_device=0,
        cached_tokens_host=0,
        error=error,  # type: ignore[arg-type]
    )
