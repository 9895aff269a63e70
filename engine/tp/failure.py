"""What rank 0 does when its tensor-parallel group can no longer run: remember the first
error (``Engine.failure``; ``/health`` turns 503 on it), get every rank out of the
collectives, and tell the watchers (the server, which then exits non-zero).

Two ways in:
- a worker died (``worker_died``, from the liveness monitor): the group is broken. The
  other workers may be inside a collective with the dead rank, so they are ended; rank 0's
  forward may be too (NCCL and MCCL wait for their timeout, gloo raises at once), so its
  communicators are aborted (``abort``, bounded, never collective).
- rank 0's own step raised (``step_failed``): the group is whole (a step goes to the
  workers only once it is complete, engine/model_runner.py), so the workers wait for the
  next message: they get the stop message and exit cleanly (``stop``, bounded).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import threading
from collections.abc import Callable, Sequence
from typing import Any

from engine.tp.liveness import end_processes, run_bounded
from engine.tp.protocol import TPRankDiedError, TPStepFailedError

logger = logging.getLogger("hiserve.tp")

# How long aborting the communicators may take before rank 0 goes on without it.
ABORT_WAIT_S = 10.0
# After rank 0's own step failed: workers waiting for a message exit at once.
FAIL_JOIN_S = 5.0
# A step that fails this soon after a worker exited failed because of that exit.
DEATH_GRACE_S = 0.5


class GroupFailure:
    """The first error that ended the group, and the reaction to it. ``workers``: the
    worker processes (rank = index + 1); ``abort``: aborts this process's communicators
    (None where a dead peer makes a collective raise by itself, gloo); ``stop(join_s)``:
    the runtime's bounded stop."""

    def __init__(
        self,
        workers: Sequence[Any],
        abort: Callable[[], object] | None,
        stop: Callable[[float], None],
        abort_wait_s: float = ABORT_WAIT_S,
    ) -> None:
        self._workers = list(workers)
        self._abort = abort
        self._stop = stop
        self._abort_wait_s = abort_wait_s
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[BaseException], None]] = []
        self.error: BaseException | None = None
        self.broken = False  # a worker died: the group can carry no message any more

    def watch(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` (on the thread that found it) when the group fails."""
        with self._lock:
            error = self.error
            if error is None:
                self._callbacks.append(callback)
        if error is not None:
            callback(error)

    def worker_died(self, rank: int) -> None:
        """Worker ``rank`` exited (the liveness monitor saw its sentinel)."""
        process = self._workers[rank - 1]
        process.join(timeout=1.0)  # for its exit code
        error = TPRankDiedError(
            f"tensor-parallel rank {rank} (pid {process.pid}) exited with code "
            f"{process.exitcode}; the engine cannot run without it and shuts down "
            "(the rank's own log lines above say why)"
        )
        if not self._record(error, broken=True):
            return
        self._notify(error)  # /health is 503 already; the server starts exiting now
        end_processes(self._workers, join_s=0.0)
        if self._abort is not None:
            run_bounded(self._abort, self._abort_wait_s, "aborting the group")

    def step_failed(self, error: BaseException) -> None:
        """Rank 0's step raised ``error``: stop the group, then tell the watchers. A worker
        that exited just before is named as the cause instead (a gloo collective with a
        dead peer raises before the monitor has said why)."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._workers, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels), timeout=DEATH_GRACE_S)
        if ready:
            self.worker_died(min(sentinels[s] for s in ready))  # type: ignore[index]
            return
        failure = TPStepFailedError(
            f"rank 0 failed in a step ({type(error).__name__}: {error}); the "
            "tensor-parallel group stops and the engine with it"
        )
        failure.__cause__ = error
        if self._record(failure, broken=False):
            self._stop(FAIL_JOIN_S)
            self._notify(failure)

    def _record(self, error: BaseException, broken: bool) -> bool:
        """Make ``error`` the failure; False if there is one already (the first wins)."""
        with self._lock:
            if self.error is not None:
                return False
            self.error = error
            self.broken = broken
        logger.error("%s", error)
        return True

    def _notify(self, error: BaseException) -> None:
        with self._lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            try:
                callback(error)
            except Exception:  # e.g. the server's event loop already closed
                logger.exception("a tensor-parallel failure callback failed")
