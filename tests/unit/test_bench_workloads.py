"""Workload generators: seeded determinism, shapes, and the ideal hit rate by hand."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.stats import percentile, summarize
from bench.workloads import WorkloadConfig, generate, ideal_cached_tokens, ideal_hit_rate

SMALL_MULTITURN = WorkloadConfig(
    workload="multiturn",
    seed=3,
    num_clients=2,
    num_rounds=3,
    system_prompt_len=4,
    user_turn_len=3,
    assistant_turn_len=2,
    output_len=5,
)


def _brute_force_cached(prompts: list[list[int]]) -> list[int]:
    """Longest common prefix with any earlier prompt, by pairwise comparison."""
    out = []
    for i, prompt in enumerate(prompts):
        best = 0
        for earlier in prompts[:i]:
            n = 0
            while n < min(len(prompt), len(earlier)) and prompt[n] == earlier[n]:
                n += 1
            best = max(best, n)
        out.append(min(best, max(len(prompt) - 1, 0)))
    return out


def test_ideal_hand_checked_cases() -> None:
    prompts = [[1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [9]]
    # [1,2,4] shares [1,2]; [1,2,3,5] shares all of [1,2,3]; [9] shares nothing.
    assert ideal_cached_tokens(prompts) == [0, 2, 3, 0]
    assert ideal_hit_rate(prompts) == pytest.approx(5 / 11)
    # A repeated prompt still computes its last token; so does a prefix of an earlier one.
    assert ideal_cached_tokens([[1, 2, 3], [1, 2, 3]]) == [0, 2]
    assert ideal_cached_tokens([[1, 2, 3, 4], [1, 2]]) == [0, 1]
    # Order matters: the longer prompt first gives the shorter one a hit.
    assert ideal_cached_tokens([[5, 6, 7], [5, 6, 7, 8]]) == [0, 3]
    assert ideal_hit_rate([]) == 0.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), max_size=8))
def test_ideal_matches_brute_force(prompts: list[list[int]]) -> None:
    assert ideal_cached_tokens(prompts) == _brute_force_cached(prompts)


def test_multiturn_structure_and_ideal() -> None:
    workload = generate(SMALL_MULTITURN)
    reqs = workload.requests
    # Round-major order: c0r0, c1r0, c0r1, c1r1, c0r2, c1r2.
    assert [(r.conversation, r.round) for r in reqs] == [
        (0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2),
    ]  # fmt: skip
    # system 4 + r * (user 3 + assistant 2) + user 3
    assert [len(r.prompt) for r in reqs] == [7, 7, 12, 12, 17, 17]
    assert all(r.max_tokens == 5 for r in reqs)
    assert reqs[0].prompt[:4] == reqs[1].prompt[:4]  # shared system prompt
    for earlier, later in ((0, 2), (2, 4), (1, 3), (3, 5)):
        # each round extends the previous round's prompt by assistant + user turns
        assert reqs[later].prompt[: len(reqs[earlier].prompt)] == reqs[earlier].prompt
    assert reqs[0].prompt[4:] != reqs[1].prompt[4:]
    assert all(1000 <= t < 40000 for r in reqs for t in r.prompt)
    # By hand: c0r0 0, c1r0 4 (system), c0r1 7, c1r1 7, c0r2 12, c1r2 12.
    assert ideal_cached_tokens([r.prompt for r in reqs]) == [0, 4, 7, 7, 12, 12]
    assert workload.ideal_hit_rate() == pytest.approx(42 / 72)
    assert workload.num_rounds == 3


def test_shared_prefix_and_random_ideal() -> None:
    config = WorkloadConfig(
        workload="shared-prefix", num_groups=2, prompts_per_group=3,
        shared_prefix_len=10, suffix_len=5,
    )  # fmt: skip
    workload = generate(config)
    assert len(workload.requests) == 6
    assert all(len(r.prompt) == 15 for r in workload.requests)
    # In each group the first prompt misses, the other two hit the 10-token prefix.
    assert workload.ideal_hit_rate() == pytest.approx(2 * 2 * 10 / 90)
    heads = {tuple(r.prompt[:10]) for r in workload.requests}
    assert len(heads) == 2
    rand = generate(WorkloadConfig(workload="random", num_prompts=16, input_len=64))
    assert [len(r.prompt) for r in rand.requests] == [64] * 16
    assert rand.ideal_hit_rate() < 0.01
    assert len({r.conversation for r in rand.requests}) == 16


@pytest.mark.parametrize("name", ["multiturn", "shared-prefix", "random"])
def test_seeded_determinism(name: str) -> None:
    config = WorkloadConfig(workload=name, seed=11, num_clients=3, num_rounds=2,
                            user_turn_len=20, num_prompts=5, input_len=20,
                            shared_prefix_len=20, suffix_len=5, range_ratio=0.5)  # fmt: skip
    first, again = generate(config), generate(config)
    assert [r.prompt for r in first.requests] == [r.prompt for r in again.requests]
    other = generate(replace(config, seed=12))
    assert [r.prompt for r in first.requests] != [r.prompt for r in other.requests]


def test_more_clients_keep_earlier_conversations() -> None:
    small = generate(SMALL_MULTITURN)
    large = generate(replace(SMALL_MULTITURN, num_clients=4))
    by_key = {(r.conversation, r.round): r.prompt for r in large.requests}
    for r in small.requests:
        assert by_key[(r.conversation, r.round)] == r.prompt


def test_range_ratio_and_vocab_range() -> None:
    config = WorkloadConfig(workload="random", num_prompts=200, input_len=40,
                            range_ratio=0.25, vocab_low=5, vocab_high=9)  # fmt: skip
    lengths = [len(r.prompt) for r in generate(config).requests]
    assert min(lengths) >= 10 and max(lengths) <= 40
    assert len(set(lengths)) > 10  # lengths really vary
    assert {t for r in generate(config).requests for t in r.prompt} == {5, 6, 7, 8}


@pytest.mark.parametrize(
    "bad",
    [{"workload": "nope"}, {"range_ratio": 0.0}, {"num_clients": 0},
     {"vocab_low": 10, "vocab_high": 10}, {"system_prompt_len": -1}],
)  # fmt: skip
def test_config_rejects_bad_values(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        WorkloadConfig(**bad)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50),
    st.floats(0, 100),
)
def test_percentile_matches_numpy(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-6)


def test_summarize() -> None:
    values = [0.5, 0.1, 0.9, 0.3, 2.0, 0.2]
    summary = summarize(values)
    assert set(summary) == {"mean", "p50", "p90", "p99"}
    assert summary["mean"] == pytest.approx(np.mean(values))
    for q in (50, 90, 99):
        assert summary[f"p{q}"] == pytest.approx(np.percentile(values, q))
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_long_tail_is_seeded_and_skewed() -> None:
    config = WorkloadConfig(
        workload="long-tail", num_groups=20, num_prompts=400, shared_prefix_len=50, suffix_len=5
    )
    first, again = generate(config), generate(config)
    assert [r.prompt for r in first.requests] == [r.prompt for r in again.requests]
    documents: dict[tuple[int, ...], int] = {}
    for request in first.requests:
        assert len(request.prompt) <= 4 * 50 + 5
        key = tuple(request.prompt[:-5])
        documents[key] = documents.get(key, 0) + 1
    counts = sorted(documents.values(), reverse=True)
    # Zipf(1.1) over 20 documents: the hottest takes ~28% of requests, the coldest ~1%.
    assert counts[0] > 0.15 * 400 and counts[0] > 5 * counts[-1]
    assert first.ideal_hit_rate() > 0.5
    with pytest.raises(ValueError, match="zipf_s"):
        WorkloadConfig(workload="long-tail", zipf_s=0)
