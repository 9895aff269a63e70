"""A dead rank is noticed without the collective backend, and nothing waits without a bound.

NCCL and MCCL cannot run here, and what makes them different from gloo is that a
collective with a dead peer blocks (until the 600 s timeout) instead of raising. So the
forward is faked by a thread blocked on an Event that only aborting the group sets: the
monitor must fire anyway, and the failure must release it. The peers are real processes
(cheap sleepers), watched through their real sentinels."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.tp.failure import FAIL_JOIN_S, GroupFailure
from engine.tp.liveness import LivenessMonitor, end_processes, run_bounded
from engine.tp.protocol import TPRankDiedError, TPStepFailedError

REPO = Path(__file__).resolve().parents[2]
SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def sleepers() -> Iterator[list[Any]]:
    """Two stand-in worker processes (ranks 1 and 2) that live until they are ended."""
    procs = [SPAWN.Process(target=time.sleep, args=(300,), daemon=True) for _ in range(2)]
    for proc in procs:
        proc.start()
    yield procs
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=5)


class BlockedCollective:
    """Rank 0's forward inside an NCCL all-reduce with a dead peer: it returns only when the
    group is aborted (``abort``), never by itself."""

    def __init__(self) -> None:
        self.aborted = threading.Event()
        self.returned = threading.Event()
        self.thread = threading.Thread(target=self._forward, daemon=True)
        self.thread.start()

    def _forward(self) -> None:
        if self.aborted.wait(timeout=120):
            self.returned.set()

    def abort(self) -> None:
        self.aborted.set()


def test_a_dead_worker_releases_a_collective_that_would_block_forever(
    sleepers: list[Any],
) -> None:
    forward = BlockedCollective()
    stops: list[float] = []
    failure = GroupFailure(sleepers, forward.abort, stops.append)
    reported: list[BaseException] = []
    failure.watch(reported.append)
    monitor = LivenessMonitor(
        {p.sentinel: rank for rank, p in enumerate(sleepers, start=1)},
        failure.worker_died,
        name="test-monitor",
    )
    monitor.start()
    try:
        time.sleep(0.3)
        assert failure.error is None and not forward.aborted.is_set()  # all alive: quiet
        killed = time.monotonic()
        sleepers[1].kill()  # rank 2 dies while rank 0 is inside the collective
        assert forward.returned.wait(timeout=15), "the blocked collective was never released"
        assert time.monotonic() - killed < 15
        monitor.join(timeout=10)
    finally:
        monitor.stop()
    assert len(reported) == 1 and reported[0] is failure.error
    error = failure.error
    assert isinstance(error, TPRankDiedError) and failure.broken
    assert f"rank 2 (pid {sleepers[1].pid})" in str(error)
    assert f"code {-signal.SIGKILL}" in str(error)
    # Rank 1 may be in the same collective with the dead rank: it is ended too.
    assert not sleepers[0].is_alive()
    assert stops == []  # a broken group gets no stop message


def test_an_abort_that_hangs_does_not_hold_up_the_report(sleepers: list[Any]) -> None:
    forever = threading.Event()
    failure = GroupFailure(sleepers, forever.wait, lambda s: None, abort_wait_s=0.5)
    reported: list[BaseException] = []
    failure.watch(reported.append)
    sleepers[0].kill()
    started = time.monotonic()
    failure.worker_died(1)
    assert time.monotonic() - started < 10
    assert len(reported) == 1 and isinstance(reported[0], TPRankDiedError)
    # A watcher that comes later hears of it at once.
    late: list[BaseException] = []
    failure.watch(late.append)
    assert late == reported


def test_a_step_failure_of_rank_0_stops_the_group_then_reports(sleepers: list[Any]) -> None:
    order: list[str] = []
    failure = GroupFailure(sleepers, None, lambda s: order.append(f"stop {s}"))
    failure.watch(lambda exc: order.append("report"))
    cause = RuntimeError("mask fill failed")
    failure.step_failed(cause)
    failure.step_failed(RuntimeError("a second one"))  # the first failure wins
    assert order == [f"stop {FAIL_JOIN_S}", "report"]
    error = failure.error
    assert isinstance(error, TPStepFailedError) and error.__cause__ is cause
    assert "RuntimeError: mask fill failed" in str(error)
    assert not failure.broken  # the workers wait for a message: they get the stop message


def test_a_step_failure_right_after_a_worker_died_names_the_death(sleepers: list[Any]) -> None:
    stops: list[float] = []
    failure = GroupFailure(sleepers, None, stops.append)
    sleepers[0].kill()
    sleepers[0].join(timeout=10)
    # gloo raised in rank 0's collective before the monitor reported the death
    failure.step_failed(RuntimeError("Connection closed by peer"))
    assert isinstance(failure.error, TPRankDiedError) and "rank 1" in str(failure.error)
    assert failure.broken and stops == [] and not sleepers[1].is_alive()


def test_monitor_stopped_on_purpose_says_nothing(sleepers: list[Any]) -> None:
    deaths: list[int] = []
    monitor = LivenessMonitor({sleepers[0].sentinel: 1}, deaths.append, name="test-monitor")
    monitor.start()
    monitor.stop()
    monitor.join(timeout=10)
    sleepers[0].kill()
    sleepers[0].join(timeout=10)
    time.sleep(0.2)
    assert deaths == []


def test_monitor_check_catches_what_no_handle_shows() -> None:
    quiet_r, quiet_w = multiprocessing.Pipe(duplex=False)  # never becomes ready
    gone = threading.Event()
    deaths: list[int] = []
    done = threading.Event()
    monitor = LivenessMonitor(
        {quiet_r: 1},
        lambda peer: (deaths.append(peer), done.set()),
        name="test-monitor",
        check=lambda: 0 if gone.is_set() else None,
        poll_s=0.05,
    )
    monitor.start()
    time.sleep(0.2)
    assert deaths == []
    gone.set()
    assert done.wait(timeout=10) and deaths == [0]
    quiet_w.close()


def test_end_processes_kills_a_worker_that_ignores_the_stop(sleepers: list[Any]) -> None:
    stuck, done = sleepers
    done.terminate()
    done.join(timeout=10)
    os.kill(stuck.pid, signal.SIGSTOP)  # alive but never runs: SIGTERM stays pending
    started = time.monotonic()
    end_processes(sleepers, join_s=0.5)
    assert time.monotonic() - started < 10
    assert not stuck.is_alive() and stuck.exitcode == -signal.SIGKILL


def test_run_bounded() -> None:
    forever = threading.Event()
    started = time.monotonic()
    assert not run_bounded(forever.wait, 0.2, "a call on a broken communicator")
    assert time.monotonic() - started < 5

    def fails() -> None:
        raise RuntimeError("backend says no")

    assert not run_bounded(fails, 5, "a failing call")
    assert run_bounded(lambda: None, 5, "a quick call")


# A "rank 0" process that starts a worker; the worker watches it (watch_parent) while its
# main thread waits forever (an NCCL collective that rank 0 will never join). liveness.py
# imports only the standard library, so it is loaded by path: no torch in these processes.
RANK0_SCRIPT = """
import importlib.util, multiprocessing, os, sys, threading

def load_liveness():
    spec = importlib.util.spec_from_file_location("liveness", {liveness!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

def worker():
    def died(rank):
        os._exit(7)
    assert load_liveness().watch_parent(died) is not None
    threading.Event().wait()

if __name__ == "__main__":
    proc = multiprocessing.get_context("spawn").Process(target=worker, daemon=True)
    proc.start()
    print(proc.pid, flush=True)
    threading.Event().wait()
"""


def test_a_worker_exits_when_rank_0_dies_even_inside_a_collective(tmp_path: Path) -> None:
    script = tmp_path / "rank0.py"
    script.write_text(RANK0_SCRIPT.format(liveness=str(REPO / "engine" / "tp" / "liveness.py")))
    rank0 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert rank0.stdout is not None
        worker_pid = int(rank0.stdout.readline())
        time.sleep(0.5)  # the worker's monitor is up (it was started before the wait)
        assert _alive(worker_pid)
        rank0.kill()  # SIGKILL: no atexit, no clean-up of its daemon children
        rank0.wait(timeout=10)
        deadline = time.monotonic() + 15
        while _alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker_pid), "the worker outlived rank 0"
    finally:
        rank0.kill()
        rank0.wait(timeout=10)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
