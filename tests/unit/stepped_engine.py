"""An Engine whose loop a test can pace, park between steps, or make crash."""

from __future__ import annotations

import threading
from typing import Any

from engine import Engine, EngineConfig
from engine.request import RequestOutput

HANG_S = 60.0  # a generation that should end but has not after this is a failure


class SteppedEngine(Engine):
    """Engine whose loop can be paced, parked between steps, or made to crash."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.step_delay = 0.0
        self.park = threading.Event()  # set: the next step waits until ``resume``
        self.parked = threading.Event()
        self.resume = threading.Event()
        self.crash: BaseException | None = None
        self.added: list[str] = []  # what was queued (add_request and the loop's enqueue)

    def enqueue(self, *args: Any, **kwargs: Any) -> str:
        request_id = super().enqueue(*args, **kwargs)
        self.added.append(request_id)
        return request_id

    def step(self) -> list[RequestOutput]:
        if self.park.is_set():
            self.parked.set()
            assert self.resume.wait(HANG_S), "never resumed"
            self.park.clear()
        if self.crash is not None:
            raise self.crash
        if self.step_delay:
            # Pacing, not synchronisation: a request of LONG cannot end within a short grace.
            threading.Event().wait(self.step_delay)
        return super().step()
