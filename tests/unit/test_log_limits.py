"""RepeatLimitFilter: a burst of each kind of record per window, then a count of the rest."""

from __future__ import annotations

import logging

from server.log_limits import RepeatLimitFilter


def _record(msg: str, exc: type[BaseException] | None = None) -> logging.LogRecord:
    info = (exc, exc(), None) if exc is not None else None
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, (), info)


def test_floods_are_cut_to_a_burst_per_window_and_counted() -> None:
    now = [0.0]
    limit = RepeatLimitFilter(burst=3, window=10.0, clock=lambda: now[0])
    passed = [limit.filter(_record("socket.accept() out of system resource", OSError))]
    for _ in range(10_000):
        passed.append(limit.filter(_record("socket.accept() out of system resource", OSError)))
    assert sum(passed) == 3
    # another kind (other message, or other exception) has its own budget
    assert limit.filter(_record("socket.accept() out of system resource", MemoryError))
    assert limit.filter(_record("Invalid HTTP request received."))
    now[0] = 10.0
    first = _record("socket.accept() out of system resource", OSError)
    assert limit.filter(first)
    assert "[9998 more like this in the last 10 s not logged]" in first.getMessage()
    again = _record("socket.accept() out of system resource", OSError)
    assert limit.filter(again) and "not logged" not in again.getMessage()
