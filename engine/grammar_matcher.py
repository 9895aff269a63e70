"""One constrained request's grammar state: its compile future, then its matcher.

Touched only by the engine thread; ``GrammarBackend.start`` (engine/grammar.py) makes it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.grammar_spec import GrammarError, GrammarSpec

# Grammar work (mask fill + accept) one request may take per generated token before it
# is ended: an ambiguous grammar's per-step cost grows without bound (issue 25: 15 ms to
# over 1 s within ten tokens), and every other request waits for it.
DEFAULT_STEP_BUDGET_S = 0.05


@dataclass(eq=False)
class RequestGrammar:
    """One request's constraint: the compile future, then its matcher (engine thread only).

    One per engine request, so each choice of an ``n`` > 1 request has its own matcher
    over the same shared compiled grammar.
    """

    spec: GrammarSpec
    future: Future[Any]
    deadline: float  # time.monotonic() by which a worker must have taken the compile
    timeout_s: float
    stop_token_ids: list[int] | None = None  # None: the tokenizer description's stop set
    matcher: Any = field(default=None, repr=False)
    step_budget_s: float = DEFAULT_STEP_BUDGET_S
    step_s: float = 0.0  # grammar time of the current step: mask fill, then accept
    compile_started: float | None = None  # when a worker was first seen compiling it

    def poll(self, now: float) -> GrammarError | None:
        """Make the matcher once the grammar is compiled; an error if it never will be."""
        if self.matcher is not None:
            return None
        if not self.future.done():
            if self.future.running() and self.compile_started is None:
                self.compile_started = now
            # NOTE: the worker stops a compile at the timeout and fails the future itself;
            # these deadlines are a backstop (one second of slack for the kill).
            if self.compile_started is not None:
                expired = now > self.compile_started + self.timeout_s + 1.0
            else:
                expired = now >= self.deadline
            if not expired:
                return None
            return GrammarError(
                f"{self.spec.param}: the constraint did not compile within "
                f"{self.timeout_s:g} s; simplify it (fewer or "
                "smaller length bounds, shorter alternations) and retry",
                self.spec.param,
            )
        error = self.future.exception()
        if error is not None:
            if isinstance(error, GrammarError):
                return error
            return GrammarError(f"{self.spec.param}: cannot compile: {error}", self.spec.param)
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(
            self.future.result(), override_stop_tokens=self.stop_token_ids
        )
        return None

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Fill ``row`` of ``bitmask`` with the allowed next tokens; False if all are.
        Starts the timing of this step (see ``over_budget``)."""
        # NOTE: CPU time of this thread, not wall time: a step the OS or the GIL held up
        # under load is not the grammar's cost, and must not end a well-formed request.
        started = time.thread_time()
        restricted = bool(self.matcher.fill_next_token_bitmask(bitmask, row))
        self.step_s = time.thread_time() - started
        return restricted

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False if the grammar did not allow it."""
        started = time.thread_time()
        ok = bool(self.matcher.accept_token(token_id))
        self.step_s += time.thread_time() - started
        return ok

    def over_budget(self) -> GrammarError | None:
        """The error ending this request if this step's grammar work (fill + accept) took
        longer than the step budget; None otherwise. Checked once per generated token."""
        if self.step_s <= self.step_budget_s:
            return None
        return GrammarError(
            f"{self.spec.param}: the constraint took {1e3 * self.step_s:.0f} ms of grammar "
            f"work for one token, above the {1e3 * self.step_budget_s:g} ms budget "
            "(--grammar-step-budget-ms); the request was ended. The grammar is too "
            "ambiguous (e.g. a rule such as `x ::= x x`): rewrite it with repetition "
            "(`x ::= [a-z]+`) and retry",
            self.spec.param,
        )

    @property
    def terminated(self) -> bool:
        """A stop token ended the grammar: the output is complete."""
        return bool(self.matcher.is_terminated())

    @property
    def may_end(self) -> bool:
        """The text so far is a complete match (a stop token is allowed next)."""
        return bool(self.matcher.is_completed())
