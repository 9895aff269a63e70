"""The KV that admission keeps back for the tokens running requests may still generate.

A request may generate up to its ``max_tokens`` (or the context's end), but most stop far
earlier; keeping all of it back would admit a few requests where dozens fit. So
admission keeps back a share of each request's remaining tokens, SGLang's scheme: the
share starts at ``INITIAL``, shrinks with every decode step down to ``FLOOR`` (the longer
the engine runs without trouble, the less it holds back), and goes back to ``INITIAL``
when a decode step runs out of KV (requests were retracted: the guess was too low) and
when the engine is idle (new traffic starts careful). Each request's remaining tokens
count up to ``CLIP`` at most.

NOTE: with a fixed share of 0.5 and no clip, chat requests without ``max_tokens`` on the
CPU (an 8,192-token context) each held back about 4,000 tokens, so about 15 of them ran
at once in the 65,536-token pool, whatever their real lengths (2026-12-06).
"""

from __future__ import annotations

INITIAL = 0.5  # the share admission used before it decayed (engine/scheduler.py)
FLOOR = 0.1
DECAY_STEPS = 600  # decode steps from INITIAL down to FLOOR (SGLang's default)
CLIP = 4096  # a request's remaining tokens counted at most (SGLang's default)


class OutputReserve:
    """The share of running requests' remaining tokens that admission keeps back."""

    def __init__(
        self,
        initial: float = INITIAL,
        floor: float = FLOOR,
        decay_steps: int = DECAY_STEPS,
        clip: int = CLIP,
    ) -> None:
        if not 0.0 <= floor <= initial:
            raise ValueError(f"reserve share floor {floor} must lie in [0, {initial}]")
        self.initial = initial
        self.floor = floor
        self.clip = clip
        self.decay = (initial - floor) / max(1, decay_steps)
        self.ratio = initial

    def fixed(self, ratio: float) -> None:
        """Keep back ``ratio`` from now on, never decaying (tests that force retraction)."""
        self.initial = self.floor = self.ratio = ratio
        self.decay = 0.0

    def tokens(self, remaining: int) -> int:
        """KV kept back for a request that may still generate ``remaining`` tokens."""
        return int(min(remaining, self.clip) * self.ratio)

    def decoded(self) -> None:
        """A decode step was scheduled without running out of KV."""
        self.ratio = max(self.floor, self.ratio - self.decay)

    def ran_out(self) -> None:
        """A decode step ran out of KV and retracted requests: be careful again."""
        self.ratio = max(self.ratio, self.initial)

    def idle(self) -> None:
        """Nothing runs: the next requests start from the initial share."""
        self.ratio = self.initial
