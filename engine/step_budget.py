"""How much prefill one step may carry: a time budget, not only a token count.

Every running stream waits for the whole step its next token is in, and a request that
arrives waits for the step in progress. On a CPU a 1,000-token prefill step is about a
second, so one long prompt held every other request that long (issue 25: two ~480-token
prompts cost an 8-token request 2.1-2.4 s on a slow day, 0.8 s on a fast one).
``--max-prefill-tokens`` cannot bound that: how long a token takes depends on the
machine, the model and the precision.

So a step's prefill is sized from the speed the engine measures: ``PrefillStepBudget``
keeps a moving estimate of the seconds per prefill token of the steps that carried
prefill, and a step takes the tokens that fit in ``prefill_step_budget_ms``, never fewer
than ``MIN_PREFILL_TOKENS`` (``FIRST_PREFILL_TOKENS`` until a step has been measured). A step's time also holds its decodes, so while many
requests decode the estimate reads high and the prefill share shrinks until the whole
step takes about the budget. Cutting prompts finer costs little here: two 480-token
prompts took 1.25-1.64 s in chunks of 64 to 1,024 tokens, in no order of size
(``max_prefill_tokens`` = chunk, on 2 cores with AMX). But a batch whose prompts all
arrive together pays for every extra step, which reads every weight once more: 19-30% of
its throughput, so the budget is off unless set (docs/limits.md). On a GPU a token is so
cheap that the budget exceeds the usual limits and changes nothing.
"""

from __future__ import annotations

# The least prefill a step carries, so a prompt keeps moving however many requests
# decode (a step's fixed cost is a few milliseconds: smaller chunks would waste it).
MIN_PREFILL_TOKENS = 64
# The prefill of a step before any has been measured: small enough to be short on a CPU
# (about 0.4 s here), and it gives the first measurement.
FIRST_PREFILL_TOKENS = 256
# Weight of the newest step in the moving estimate.
SMOOTHING = 0.5


class PrefillStepBudget:
    """The prefill tokens the next step may carry (``None``: only the token limits)."""

    def __init__(self, budget_ms: float | None, min_tokens: int = MIN_PREFILL_TOKENS) -> None:
        self.budget_s = None if budget_ms is None else budget_ms / 1000.0
        self.min_tokens = min_tokens
        self.seconds_per_token: float | None = None  # no prefill step measured yet

    def observe(self, prefill_tokens: int, seconds: float) -> None:
        """A step with ``prefill_tokens`` prompt tokens (and any decodes) took ``seconds``."""
        if prefill_tokens < self.min_tokens or seconds <= 0:
            return  # a few tokens say more about the step's fixed cost than about prefill
        rate = seconds / prefill_tokens
        old = self.seconds_per_token
        self.seconds_per_token = rate if old is None else old + SMOOTHING * (rate - old)

    def tokens(self) -> int | None:
        """Prefill tokens for the next step; None: no budget."""
        if self.budget_s is None:
            return None
        if self.seconds_per_token is None:
            return max(self.min_tokens, FIRST_PREFILL_TOKENS)
        return max(self.min_tokens, int(self.budget_s / self.seconds_per_token))
