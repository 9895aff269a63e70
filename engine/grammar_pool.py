"""Grammar compiles in worker processes that are killed when they run out of time.

A compile inside xgrammar cannot be interrupted: in a thread, a constraint that takes
minutes holds its worker for minutes whatever the timeout says (issue 25: two 7 KB
regexes starved the pool, and an unrelated ``guided_choice`` failed). Here each worker
slot is a thread driving one child process; past the timeout the child is killed, the
request gets its error, and the slot starts a fresh child for the next compile.

Compiled grammars come back serialized (``CompiledGrammar.serialize_json``) and are kept
in a cache bounded in bytes (their ``memory_size_bytes``); failures and timeouts are
never kept, so a retry compiles again. After reading a large one back, the C heap's free
pages go back to the OS (``trim_heap``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from engine.child_process import module_command
from engine.grammar_spec import GrammarError, GrammarSpec
from engine.heap import trim_heap

logger = logging.getLogger("hiserve.grammar")

# Compiled grammars kept for reuse, in bytes of xgrammar's own accounting.
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
# How much nicer than the server a compile worker runs. A compile is background work that
# may take tens of seconds; where cores are few, two workers at the server's priority
# took the engine thread's CPU (the 8-token canary went from 0.2 s to 2.3 s on 2 cores
# during two slow compiles), so the scheduler gives them only what the engine leaves.
# The slot threads that take the compiled grammars in run at the same niceness: reading
# a big one back (``deserialize_json``, about 0.8 s for a 65 MB grammar, without the GIL)
# competed with the engine for the cores just as the compile did.
COMPILE_NICENESS = 10
# A serialized grammar this large is given back to the OS once read: the JSON text and
# its parse are ~50x the compiled grammar (two 10 MB grammars of issue 25's slow schemas
# left the server 1 GB larger for good, as glibc keeps freed pages for reuse).
TRIM_AFTER_PAYLOAD_CHARS = 16 * 1024 * 1024


def compile_niceness() -> int:
    """The niceness of compile work: the calling thread's plus ``COMPILE_NICENESS``."""
    try:
        return min(19, os.getpriority(os.PRIO_PROCESS, 0) + COMPILE_NICENESS)
    except (AttributeError, OSError):  # no priorities on this OS
        return COMPILE_NICENESS


def lower_priority(niceness: int, this_thread: bool) -> None:
    """Run this process (or only the calling thread) at ``niceness`` if it is nicer than
    now. Threads have their own niceness on Linux only; elsewhere a thread keeps the
    server's priority (the id would name a process, not this thread)."""
    if this_thread and not sys.platform.startswith("linux"):
        return
    who = threading.get_native_id() if this_thread else 0
    try:
        if os.getpriority(os.PRIO_PROCESS, who) < niceness:
            os.setpriority(os.PRIO_PROCESS, who, niceness)
    except (AttributeError, OSError) as exc:  # compile at the server's priority
        logger.warning("grammar compile work keeps the server's priority: %s", exc)


class _Child:
    """One worker process (engine/grammar_worker.py) and our end of its socket.

    NOTE: a plain child process (engine/child_process.py), not a multiprocessing one: a
    script that builds an engine without a main guard built a second and a third one in
    the two spawned workers, whose own start then failed, and every compile retried it.
    """

    def __init__(self, tokenizer_info_json: str, niceness: int) -> None:
        ours, theirs = socket.socketpair()
        cmd = module_command("engine.grammar_worker", str(theirs.fileno()), str(niceness))
        try:
            self.process = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),)
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        # Read once its imports are done. If it died on the way, the caller's start check
        # (no "ready") reports it.
        with contextlib.suppress(OSError):
            self.conn.send(tokenizer_info_json)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        self.conn.close()


class CompilePool:
    """Compiles ``GrammarSpec``s in ``workers`` killable processes, each distinct one once."""

    def __init__(
        self,
        tokenizer_info: Any,
        workers: int,
        timeout_s: float,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.info = tokenizer_info
        self.timeout_s = timeout_s
        self.cache_bytes = cache_bytes
        self.start_timeout_s = start_timeout_s
        self._info_json: str = tokenizer_info.serialize_json()
        self._niceness = compile_niceness()
        self._jobs: queue.Queue[tuple[GrammarSpec, Future[Any]] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending: dict[GrammarSpec, Future[Any]] = {}
        self._done: OrderedDict[GrammarSpec, tuple[Future[Any], int]] = OrderedDict()
        self.cached_bytes = 0
        self.kills = 0  # compiles killed at the timeout (tests, logs)
        self._children: list[_Child | None] = [None] * workers
        # Set once each slot's first worker has started (or failed to start).
        self._started = [threading.Event() for _ in range(workers)]
        self._slots = [
            threading.Thread(target=self._run_slot, args=(i,), name=f"hiserve-grammar-{i}")
            for i in range(workers)
        ]
        for slot in self._slots:
            slot.daemon = True
            slot.start()

    # ------------------------------------------------------------------ callers
    def wait_started(self, timeout_s: float) -> bool:
        """Block until every slot's first worker has started (or failed to); whether they
        all did within ``timeout_s``.

        NOTE: a worker's start took 1.5-3 s of CPU while it imported torch (it no longer
        does: engine/grammar_worker.py; about 0.6 s now). A server that answered ready
        before then had the workers take that time from its first requests' steps even at
        their niceness: on 2 cores the served throughput of the first 15 s fell to 70-84%
        of offline (``python -m bench.http_cost``).
        """
        deadline = time.monotonic() + timeout_s
        return all(e.wait(max(0.0, deadline - time.monotonic())) for e in self._started)

    def submit(self, spec: GrammarSpec) -> Future[Any]:
        """The compiled grammar of ``spec``: cached, in flight, or queued now."""
        with self._lock:
            hit = self._done.get(spec)
            if hit is not None:
                self._done.move_to_end(spec)
                return hit[0]
            future = self._pending.get(spec)
            if future is None:
                future = Future()
                self._pending[spec] = future
                self._jobs.put((spec, future))
            return future

    def close(self) -> None:
        for _ in self._slots:
            self._jobs.put(None)
        with self._lock:
            children, self._children = self._children, [None] * len(self._children)
        for child in children:
            if child is not None:
                child.kill()

    # ------------------------------------------------------------------ slots
    def _run_slot(self, slot: int) -> None:
        lower_priority(self._niceness, this_thread=True)
        try:
            self._child(slot)  # start the worker now, not on the first request
        except Exception as exc:
            logger.warning("grammar compile worker %d did not start: %s", slot, exc)
        finally:
            self._started[slot].set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            spec, future = job
            future.set_running_or_notify_cancel()  # requests time the compile from here
            try:
                compiled = self._compile(slot, spec)
            except GrammarError as exc:
                with self._lock:
                    self._pending.pop(spec, None)  # failures are not kept: a retry compiles
                future.set_exception(exc)
                continue
            except Exception as exc:  # a dead worker, a broken pipe: this compile fails
                logger.warning("grammar compile worker failed: %s", exc)
                self._replace(slot)
                with self._lock:
                    self._pending.pop(spec, None)
                future.set_exception(
                    GrammarError(f"{spec.param}: cannot compile: {exc}", spec.param)
                )
                continue
            self._keep(spec, future, compiled)
            future.set_result(compiled)

    def _child(self, slot: int) -> _Child:
        child = self._children[slot]
        if child is None or not child.alive():
            child = _Child(self._info_json, self._niceness)
            if not child.conn.poll(self.start_timeout_s):
                child.kill()
                raise RuntimeError("the compile worker did not start")
            child.conn.recv()  # "ready"
            with self._lock:
                self._children[slot] = child
        return child

    def _replace(self, slot: int) -> None:
        with self._lock:
            child, self._children[slot] = self._children[slot], None
        if child is not None:
            child.kill()

    def _compile(self, slot: int, spec: GrammarSpec) -> Any:
        child = self._child(slot)
        started = time.monotonic()
        text = spec.value if spec.kind in ("json_schema", "regex") else spec.as_ebnf()
        child.conn.send((spec.kind, text))
        if not child.conn.poll(self.timeout_s):
            self.kills += 1
            self._replace(slot)  # the only way to stop a compile: its process goes
            raise GrammarError(
                f"{spec.param}: the constraint did not compile within {self.timeout_s:g} s "
                "and its compile was stopped; simplify it (fewer or smaller length bounds, "
                "shorter alternations) and retry",
                spec.param,
            )
        status, payload = child.conn.recv()
        if status != "ok":
            raise GrammarError(f"{spec.param}: cannot compile: {payload}", spec.param)
        import xgrammar as xgr

        compiled = xgr.CompiledGrammar.deserialize_json(payload, self.info)
        if len(payload) >= TRIM_AFTER_PAYLOAD_CHARS:
            del payload
            trim_heap()
        logger.debug(
            "compiled %s grammar in %.1f ms", spec.kind, 1e3 * (time.monotonic() - started)
        )
        return compiled

    def _keep(self, spec: GrammarSpec, future: Future[Any], compiled: Any) -> None:
        size = int(compiled.memory_size_bytes)
        with self._lock:
            self._pending.pop(spec, None)
            if size > self.cache_bytes:
                return  # served to its requests, never kept
            self._done[spec] = (future, size)
            self.cached_bytes += size
            while self.cached_bytes > self.cache_bytes:
                _, (_, evicted) = self._done.popitem(last=False)
                self.cached_bytes -= evicted
