"""Turn-taking between the copies of one API request (``n`` > 1) at admission."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from engine.request import Req

# Copies of one API request (SamplingParams.group) admitted per prefill step. The copies
# of a large-n request queue together; taking a few per step and then moving on lets the
# requests behind them in at once, rather than after the whole group (issue 25 item 5).
GROUP_ADMITS_PER_STEP = 2


class GroupTurns:
    """One prefill step's admission turns of the API requests' copies.

    NOTE: fairness between API requests: a group takes at most ``GROUP_ADMITS_PER_STEP``
    admissions per step, and at most half the running slots while others wait. Requests
    without a group (``n`` = 1) always have their turn.
    """

    def __init__(self, running: Iterable[Req], waiting: Iterable[Req], max_running: int) -> None:
        self.share = max(1, max_running // 2)
        self.holding = Counter(r.params.group for r in running if r.params.group is not None)
        self.taken: Counter[str] = Counter()
        self._waiting_groups = Counter(r.params.group for r in waiting)

    def may_admit(self, req: Req) -> bool:
        """False while ``req``'s other copies have had their turn: those behind go first."""
        group = req.params.group
        if group is None:
            return True
        if self.taken[group] >= GROUP_ADMITS_PER_STEP:
            return False
        return self.holding[group] < self.share or not self._others_wait(group)

    def admitted(self, req: Req) -> None:
        group = req.params.group
        self._waiting_groups[group] -= 1
        if group is not None:
            self.taken[group] += 1
            self.holding[group] += 1

    def _others_wait(self, group: str) -> bool:
        """Whether a waiting request belongs to another API request than ``group``."""
        return any(n > 0 for g, n in self._waiting_groups.items() if g != group)
