"""Copies of a large-n request take turns with other requests (issue 25 item 5): a small
request that arrives behind 32 copies is admitted within a step, counted in engine steps.

The reference is the same queue without groups (each copy on its own, as before): there
the small request waits until the copies ahead of it have been admitted.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from engine import Engine, SamplingParams
from engine.group_turns import GROUP_ADMITS_PER_STEP
from tests.unit.cpu_engine import checked_engine
from tests.unit.model_configs import random_prompts

COPIES = 32
MAX_RUNNING = 8
COPY = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
SMALL = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def _steps_until_small_finishes(engine: Engine, grouped: bool) -> tuple[int, dict[str, list[int]]]:
    shared = random_prompts([64], 7)[0]
    engine.generate([shared], COPY)  # the prefix is cached: no copy waits on another
    copy = dataclasses.replace(COPY, group="big" if grouped else None)
    small = dataclasses.replace(SMALL, group="small" if grouped else None)
    ids = [engine.add_request(shared, copy) for _ in range(COPIES)]
    small_id = engine.add_request(random_prompts([8], 8)[0], small)
    finished: dict[str, list[int]] = {}
    steps = 0
    small_done_at = 0
    while engine.has_work:
        steps += 1
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
                if out.request_id == small_id:
                    small_done_at = steps
    assert set(finished) == {*ids, small_id}  # nobody starves, nothing is lost
    return small_done_at, {i: finished[i] for i in ids}


def test_small_request_is_not_starved_by_many_copies(tiny_llama_dir: Path) -> None:
    engine = checked_engine(tiny_llama_dir, kv_cache_tokens=4096, max_running_requests=MAX_RUNNING)
    ungrouped_at, ungrouped = _steps_until_small_finishes(engine, grouped=False)
    engine.flush_cache()
    grouped_at, grouped = _steps_until_small_finishes(engine, grouped=True)
    print(f"small request done at step {ungrouped_at} ungrouped, {grouped_at} grouped")
    # ungrouped: the copies ahead fill every free slot, MAX_RUNNING a step
    assert ungrouped_at >= COPIES // MAX_RUNNING, ungrouped_at
    # grouped: admitted in the first step (the copies take GROUP_ADMITS_PER_STEP of the
    # slots), then one decode step for its second token
    assert grouped_at <= 2, grouped_at
    assert GROUP_ADMITS_PER_STEP < MAX_RUNNING
    # the same greedy tokens for every copy either way
    assert len({tuple(t) for t in [*grouped.values(), *ungrouped.values()]}) == 1
