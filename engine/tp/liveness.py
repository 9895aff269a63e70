"""Knowing that a rank died without asking the collective backend, and ending ranks within
a bound.

A gloo collective with a dead peer raises at once; NCCL and MCCL wait for the collective
timeout (600 s) before their watchdog reacts. So every rank watches its peers through the
operating system instead: rank 0 waits on its workers' process sentinels, each worker on
its parent's (the pipe that closes when rank 0 exits). A ``LivenessMonitor`` thread never
enters the backend, so it fires while another thread of the process is blocked inside a
collective that would never return.

Nothing here may hang: ``run_bounded`` gives a call that can block on a broken
communicator (a stop message, destroy, abort) a deadline, and ``end_processes`` joins,
then terminates, then kills.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

logger = logging.getLogger("hiserve.tp")

# After SIGTERM, and again after SIGKILL, a process gets this long to be reaped.
SIGNAL_JOIN_S = 3.0


class LivenessMonitor:
    """A daemon thread that calls ``on_death(peer)`` once, when the handle of ``peer`` in
    ``handles`` becomes ready (a process sentinel: the process exited; a pipe end: the
    process holding the other end exited), or when ``check()`` names a dead peer
    (polled every ``poll_s`` seconds; for what a handle cannot show). ``stop()`` ends it
    without a call (an orderly shutdown, where peers exit on purpose)."""

    def __init__(
        self,
        handles: Mapping[Any, int],
        on_death: Callable[[int], None],
        name: str,
        check: Callable[[], int | None] | None = None,
        poll_s: float = 1.0,
    ) -> None:
        self._handles = dict(handles)
        self._on_death = on_death
        self._check = check
        self._poll_s = poll_s
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._wake_w.send(None)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        waited = [*self._handles, self._wake_r]
        timeout = self._poll_s if self._check is not None else None
        while True:
            ready = multiprocessing.connection.wait(waited, timeout=timeout)
            if self._stopped.is_set():
                return
            dead = [self._handles[h] for h in ready if h in self._handles]
            if not dead and self._check is not None:
                peer = self._check()
                dead = [peer] if peer is not None else []
            if dead:
                break
        try:
            self._on_death(min(dead))
        except Exception:  # the thread must not die silently either
            logger.exception("handling the death of tensor-parallel rank %d failed", min(dead))


def run_bounded(call: Callable[[], object], timeout_s: float, what: str) -> bool:
    """Run ``call`` on a daemon thread and wait at most ``timeout_s`` for it; True when it
    returned in time without raising. A call still blocked (on a broken communicator) is
    left behind: the process is on its way out, and waiting would hang it."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            call()
        except BaseException as exc:  # reported below, on the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=target, name=f"hiserve-tp-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning("tensor parallel: %s did not finish within %.0f s", what, timeout_s)
        return False
    if errors:
        logger.warning("tensor parallel: %s failed: %s", what, errors[0])
        return False
    return True


def end_processes(processes: Sequence[Any], join_s: float) -> None:
    """Wait up to ``join_s`` for ``processes`` (multiprocessing.Process) to exit, then
    terminate the ones left, then kill the ones that still do not exit. Returns within
    about ``join_s + 2 * SIGNAL_JOIN_S``: a rank stuck in a collective, or stopped, never
    holds up the server's exit."""
    for signal_name, wait_s in (
        ("", join_s),
        ("terminate", SIGNAL_JOIN_S),
        ("kill", SIGNAL_JOIN_S),
    ):
        alive = [p for p in processes if p.is_alive()]
        if not alive:
            return
        if signal_name:
            logger.warning("tensor parallel: %s worker(s) %s", signal_name, [p.pid for p in alive])
            for process in alive:
                getattr(process, signal_name)()
        deadline = time.monotonic() + wait_s
        for process in alive:
            process.join(timeout=max(0.0, deadline - time.monotonic()))


def watch_parent(on_death: Callable[[int], None]) -> LivenessMonitor | None:
    """Start a monitor that calls ``on_death(0)`` when this process's parent (rank 0, for
    a worker) exits; None when multiprocessing did not start this process. The parent's
    sentinel is a pipe that closes when the parent exits; the parent pid is checked too,
    in case a child of the parent inherited the pipe's other end."""
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if parent is None or sentinel is None:
        return None
    parent_pid = os.getppid()
    monitor = LivenessMonitor(
        {sentinel: 0},
        on_death,
        name="hiserve-tp-rank0-monitor",
        check=lambda: 0 if os.getppid() != parent_pid else None,
    )
    monitor.start()
    return monitor
