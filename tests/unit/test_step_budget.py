"""A step's prefill sized by time (engine/step_budget.py), and what the scheduler does with
it: a long prompt goes in chunks that fit the budget, and a request that arrives while it
is cut up is admitted at once instead of after its last chunk."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine import Engine, SamplingParams
from engine.config import EngineConfig
from engine.sampler_output import SamplerOutput
from engine.scheduled_batch import ScheduledBatch
from engine.step_budget import FIRST_PREFILL_TOKENS, MIN_PREFILL_TOKENS, PrefillStepBudget
from tests.unit.cpu_engine import checked_engine
from tests.unit.model_configs import random_prompts

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def test_no_budget_means_no_cap() -> None:
    budget = PrefillStepBudget(None)
    budget.observe(1000, 1.0)
    assert budget.tokens() is None


def test_the_first_step_is_small_then_the_measured_speed_sizes_the_steps() -> None:
    budget = PrefillStepBudget(100.0)
    assert budget.tokens() == FIRST_PREFILL_TOKENS
    budget.observe(500, 0.5)  # 1 ms a token: 100 tokens in 100 ms
    assert budget.tokens() == 100
    budget.observe(100, 0.05)  # 0.5 ms a token; the estimate moves halfway: 0.75 ms
    assert budget.tokens() == 133
    budget.observe(MIN_PREFILL_TOKENS - 1, 10.0)  # too few tokens to say anything
    assert budget.tokens() == 133
    budget.observe(100, 1.0)  # a slow step: never under the floor
    assert budget.tokens() == MIN_PREFILL_TOKENS


def test_the_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="prefill_step_budget_ms"):
        EngineConfig(model="default", prefill_step_budget_ms=0)


def _run(engine: Engine, fixed_tokens: int | None) -> tuple[list[int], int, dict[str, list[int]]]:
    """A 600-token prompt, then an 8-token one after the first step. Returns each step's
    prefill tokens, the step the short request first ran in, and the tokens of both."""
    budget = engine.scheduler.step_budget
    if fixed_tokens is not None:  # a fixed speed, so the steps do not depend on the clock
        budget.seconds_per_token = budget.budget_s / fixed_tokens  # type: ignore[operator]
        budget.observe = lambda *args: None  # type: ignore[method-assign]
    steps: list[int] = []
    schedule = engine.scheduler.schedule

    def recorded() -> ScheduledBatch | None:
        batch = schedule()
        if batch is not None:
            steps.append(batch.num_prefill_tokens)
        return batch

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    long_prompt, short_prompt = random_prompts([600, 8], seed=1)
    long_id = engine.add_request(long_prompt, GREEDY)
    outputs: dict[str, list[int]] = {}
    short_id = ""
    short_at = 0
    while engine.has_work or not short_id:
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        if not short_id:
            short_id = engine.add_request(short_prompt, GREEDY)
            short_at = len(steps) + 1
    return steps, short_at, {"long": outputs[long_id], "short": outputs[short_id]}


def test_a_long_prompt_goes_in_budget_sized_chunks_and_lets_others_in(
    tiny_llama_dir: Path,
) -> None:
    capped = checked_engine(tiny_llama_dir, kv_cache_tokens=2048, prefill_step_budget_ms=100.0)
    steps, short_at, capped_out = _run(capped, fixed_tokens=64)
    # every step that held prefill held at most the budget's 64 tokens
    assert max(steps) <= 64 and sum(steps) == 600 + 8, steps
    # the short request went into the step right after it arrived, next to a chunk of
    # the long one (32 + 8 tokens): not behind the other eight chunks
    assert steps[short_at - 1] == 32 + 8, (short_at, steps)
    uncapped = checked_engine(tiny_llama_dir, kv_cache_tokens=2048, prefill_step_budget_ms=None)
    steps, _, uncapped_out = _run(uncapped, fixed_tokens=None)
    assert steps[0] == 600  # one step (chunked_prefill_size is 1024)
    assert capped_out == uncapped_out  # the same greedy tokens either way


def test_a_step_is_timed_from_before_its_forward(tiny_llama_dir: Path) -> None:
    # The step's start was taken after the forward had run (on a CPU it runs inside the
    # launch): every prefill step looked nearly free, to the budget and the log alike.
    engine = checked_engine(tiny_llama_dir, kv_cache_tokens=1024)
    seen: list[tuple[int, float]] = []

    def observe(prefill_tokens: int, seconds: float) -> None:
        seen.append((prefill_tokens, seconds))

    engine.scheduler.step_budget.observe = observe  # type: ignore[method-assign]
    run = engine.runner.run

    def slow(batch: ScheduledBatch) -> SamplerOutput | None:
        time.sleep(0.2)
        return run(batch)

    engine.runner.run = slow  # type: ignore[method-assign]
    engine.generate(random_prompts([100], seed=3), GREEDY)
    assert seen[0][0] == 100 and seen[0][1] >= 0.2, seen
