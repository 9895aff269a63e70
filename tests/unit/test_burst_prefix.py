"""A burst of requests sharing a prefix computes that prefix once (issue 13).

24 requests whose prompts share a 20-120 token prefix are submitted together; at most one
of them may compute the prefix, and the others must hit it in the cache. Hits and computed
prompt tokens come from the engine's own counters; every policy runs with HiCache on and
off. A fairness check bounds how long a request can be passed over by later arrivals.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import Engine, SamplingParams
from engine.request import ReqStatus
from engine.scheduler import MAX_TIMES_PASSED
from tests.unit.cpu_engine import checked_engine

BURST = 24
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _engine(model_dir: Path, **kw: object) -> Engine:
    return checked_engine(model_dir, **{"kv_cache_tokens": 4096, **kw})


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def _burst(prefix_len: int, seed: int) -> tuple[list[list[int]], int]:
    """``BURST`` prompts: one shared prefix, then a distinct 3-12 token suffix each;
    also the number of distinct prompt tokens in the burst (prefix once, every suffix)."""
    rng = random.Random(seed)
    prefix = _tokens(rng, prefix_len)
    suffixes = [_tokens(rng, rng.randrange(3, 13)) for _ in range(BURST)]
    return [prefix + s for s in suffixes], prefix_len + sum(len(s) for s in suffixes)


@pytest.mark.parametrize("hicache", [False, True], ids=["radix", "hicache"])
@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
@pytest.mark.parametrize("prefix_len", [20, 120])
def test_burst_computes_its_shared_prefix_once(
    tiny_llama_dir: Path, policy: str, hicache: bool, prefix_len: int
) -> None:
    engine = _engine(tiny_llama_dir, schedule_policy=policy, enable_hierarchical_cache=hicache)
    prompts, unique_tokens = _burst(prefix_len, seed=prefix_len)
    outs = engine.generate(prompts, PARAMS)
    counters = engine.counters
    hits = sum(1 for out in outs if out.cached_tokens > 0)
    cached = counters["cached_tokens_device_total"] + counters["cached_tokens_host_total"]
    computed = counters["prompt_tokens_total"] - cached
    assert counters["prompt_tokens_total"] == sum(len(p) for p in prompts)
    assert hits >= 20, f"only {hits} of {BURST} requests hit the cache"
    assert computed <= 1.1 * unique_tokens, (computed, unique_tokens)
    # The per-request figures add up to the engine's counters.
    assert sum(out.prompt_tokens - out.cached_tokens for out in outs) == computed


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_burst_matches_outputs_without_the_cache(tiny_llama_dir: Path, policy: str) -> None:
    """Sharing changes what is computed, never the tokens (greedy)."""
    prompts, _ = _burst(60, seed=7)
    expected = [
        o.token_ids
        for o in _engine(tiny_llama_dir, enable_prefix_cache=False).generate(prompts, PARAMS)
    ]
    got = [
        o.token_ids
        for o in _engine(tiny_llama_dir, schedule_policy=policy).generate(prompts, PARAMS)
    ]
    assert got == expected


# A request may be passed by later arrivals while the prefill it waits for is in flight
# (at most ceil(prefix / chunk) = 4 prefill steps below), and by lpm's reordering
# MAX_TIMES_PASSED times; never for as long as later arrivals keep coming.
MAX_PASSED_STEPS = MAX_TIMES_PASSED + 4


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_no_request_waits_unboundedly_behind_later_arrivals(
    tiny_llama_dir: Path, policy: str
) -> None:
    """The burst plus unrelated prompts, then a stream of late arrivals that share the
    burst's (by then cached) prefix, with few running slots so that order matters."""
    engine = _engine(
        tiny_llama_dir,
        schedule_policy=policy,
        max_running_requests=4,
        chunked_prefill_size=32,
    )
    rng = random.Random(11)
    prompts, _ = _burst(120, seed=11)
    prefix = prompts[0][:120]
    prompts += [_tokens(rng, 40) for _ in range(4)]  # no prefix in common with anything
    arrival: dict[str, int] = {}
    for prompt in prompts:
        arrival[engine.add_request(prompt, PARAMS)] = len(arrival)
    passed: dict[str, int] = dict.fromkeys(arrival, 0)
    admitted: set[str] = set()
    late_left = 60
    steps = 0
    while engine.has_work:
        steps += 1
        assert steps < 2000, "the engine stopped making progress"
        if late_left:  # one more request sharing the hot prefix every step
            late_left -= 1
            rid = engine.add_request(prefix + _tokens(rng, 5), PARAMS)
            arrival[rid] = len(arrival)
            passed[rid] = 0
        waiting_before = {r.request_id for r in engine.scheduler.waiting}
        engine.step()
        newly = {
            rid
            for rid in waiting_before
            if rid not in admitted
            and (rid not in engine.requests or engine.requests[rid].status != ReqStatus.WAITING)
        }
        admitted |= newly
        if not newly:
            continue
        latest = max(arrival[rid] for rid in newly)
        for rid in waiting_before - newly:
            if arrival[rid] < latest:
                passed[rid] += 1
    worst = max(passed.values())
    assert worst <= MAX_PASSED_STEPS, f"a request was passed by later arrivals {worst} times"
    assert admitted == set(arrival)
