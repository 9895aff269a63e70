"""Rate limits on repeated log records: a flood of connections must not become a flood of
tracebacks (issue 25 item 6 saw 518,143 of them, 230 MB, in 30 s)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

# The loggers an attacker can make repeat: accept errors (asyncio), protocol errors
# (uvicorn.error), refused and timed-out connections (hiserve.connections).
LIMITED_LOGGERS = ("asyncio", "uvicorn.error", "hiserve.connections")
MAX_KINDS = 1024  # distinct kinds remembered; past it the oldest window is dropped


@dataclass
class _Window:
    start: float
    passed: int = 0
    suppressed: int = 0


class RepeatLimitFilter(logging.Filter):
    """Lets at most ``burst`` records of one kind (logger, level, message template,
    exception type) through per ``window`` seconds. The first record of the next window
    says how many were dropped."""

    def __init__(
        self, burst: int = 5, window: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.burst = burst
        self.window = window
        self.clock = clock
        self._windows: dict[tuple[object, ...], _Window] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        exc_type = record.exc_info[0] if record.exc_info else None
        kind = (record.name, record.levelno, str(record.msg)[:200], exc_type)
        now = self.clock()
        window = self._windows.get(kind)
        if window is None or now - window.start >= self.window:
            dropped = window.suppressed if window is not None else 0
            if window is None and len(self._windows) >= MAX_KINDS:
                del self._windows[next(iter(self._windows))]
            self._windows.pop(kind, None)
            self._windows[kind] = _Window(start=now, passed=1)
            if dropped:
                note = f" [{dropped} more like this in the last {self.window:.0f} s not logged]"
                record.msg = str(record.msg) + note
            return True
        if window.passed < self.burst:
            window.passed += 1
            return True
        window.suppressed += 1
        return False


def install_repeat_limits(names: tuple[str, ...] = LIMITED_LOGGERS) -> None:
    """Add one ``RepeatLimitFilter`` to each logger in ``names`` (idempotent)."""
    for name in names:
        target = logging.getLogger(name)
        if not any(isinstance(f, RepeatLimitFilter) for f in target.filters):
            target.addFilter(RepeatLimitFilter())
