"""The KV admission keeps back for running requests' future tokens shrinks while decode goes
well, and comes back when it does not (engine/output_reserve.py).

The engine test counts how many requests run at once against a pool that the initial
share fills with a few, and compares every output with an engine whose pool holds all of
them at once (greedy), while KV accounting is checked after every step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import SamplingParams
from engine.output_reserve import CLIP, FLOOR, INITIAL, OutputReserve
from tests.unit.cpu_engine import checked_engine
from tests.unit.model_configs import random_prompts


def test_the_share_decays_to_its_floor_and_comes_back_when_decode_runs_out() -> None:
    reserve = OutputReserve(decay_steps=10)
    assert reserve.ratio == INITIAL
    ratios = []
    for _ in range(12):
        reserve.decoded()
        ratios.append(reserve.ratio)
    assert ratios[0] < INITIAL and ratios == sorted(ratios, reverse=True)
    assert ratios[9] == pytest.approx(FLOOR) and ratios[-1] == FLOOR
    reserve.ran_out()
    assert reserve.ratio == INITIAL
    for _ in range(5):
        reserve.decoded()
    reserve.idle()
    assert reserve.ratio == INITIAL


def test_a_request_counts_its_remaining_tokens_up_to_the_clip() -> None:
    reserve = OutputReserve()
    assert reserve.tokens(1000) == int(1000 * INITIAL)
    assert reserve.tokens(100_000) == reserve.tokens(CLIP) == int(CLIP * INITIAL)


def test_a_fixed_share_never_moves() -> None:
    reserve = OutputReserve()
    reserve.fixed(0.0)
    for _ in range(3):
        reserve.decoded()
    reserve.ran_out()
    reserve.idle()
    assert reserve.ratio == 0.0 and reserve.tokens(500) == 0


def test_more_requests_run_once_the_share_has_decayed_and_outputs_do_not_change(
    tiny_llama_dir: Path,
) -> None:
    prompts = random_prompts([16] * 10, seed=3)
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    reference = checked_engine(tiny_llama_dir, kv_cache_tokens=4096).generate(prompts, params)

    # Each request keeps back 0.5 x 80 = 40 tokens at first: 5 of them fill 300.
    engine = checked_engine(tiny_llama_dir, kv_cache_tokens=300)
    engine.scheduler.reserve = OutputReserve(decay_steps=10)
    for prompt in prompts:
        engine.add_request(prompt, params)
    running: list[int] = []
    outputs: dict[str, list[int]] = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        running.append(len(engine.scheduler.running))
    assert running[0] <= 5
    assert max(running) > running[0], running
    # They outgrow the pool (10 x 96 tokens): decode retracts, and the share is back up.
    assert engine.scheduler.num_retractions > 0
    got = sorted(outputs.values())
    assert got == sorted(out.token_ids for out in reference)
