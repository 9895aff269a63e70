"""Requests that share a prompt prefix with an in-flight prefill wait for it to land in the
radix cache instead of computing the same tokens again (the copies of an n > 1 request).

Computed prompt tokens are counted from what the engine reports per request
(``prompt - cached``); KV accounting (``free + owned + cached == capacity``) is checked
after every step; outputs are compared with an engine that shares nothing.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import Engine, SamplingParams
from engine.prefill_sharing import MIN_SHARED_TOKENS, common_prefix_len
from engine.request import RequestOutput
from tests.unit.cpu_engine import checked_engine
from tests.unit.model_configs import random_prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# The test prompts (the reference fixture's greedy tokens are for these).
SHARED, UNRELATED, LONG = random_prompts([60, 25, 70])


def _engine(model_dir: Path, **kw: object) -> Engine:
    return checked_engine(model_dir, **{"kv_cache_tokens": 2048, **kw})


def _check_idle(engine: Engine) -> None:
    manager = engine.kv.manager
    assert manager.allocator.free_tokens + manager.tree.cached_tokens == manager.capacity
    assert manager.tree.protected_tokens == 0


def _computed(outs: list[RequestOutput]) -> int:
    return sum(out.prompt_tokens - out.cached_tokens for out in outs)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> dict[tuple[int, ...], list[int]]:
    """Greedy tokens of each test prompt from an engine with the prefix cache off."""
    engine = _engine(tiny_llama_dir, enable_prefix_cache=False)
    prompts = [SHARED, UNRELATED, LONG]
    outs = engine.generate(prompts, GREEDY)
    return {tuple(p): o.token_ids for p, o in zip(prompts, outs, strict=True)}


@pytest.mark.parametrize("page_size", [1, 4])
def test_copies_share_one_prefill_and_unrelated_requests_are_not_held_back(
    tiny_llama_dir: Path, reference: dict[tuple[int, ...], list[int]], page_size: int
) -> None:
    engine = _engine(tiny_llama_dir, page_size=page_size)
    shared, unrelated = SHARED, UNRELATED
    prompts = [shared] * 4 + [unrelated]
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    # The first prefill batch holds one copy and the unrelated prompt; the copies wait.
    batch = engine.scheduler.schedule()
    assert batch is not None and not batch.is_decode
    assert [r.request_id for r in batch.reqs] == [ids[0], ids[4]]
    assert batch.num_tokens == len(shared) + len(unrelated)
    result = engine.runner.run(batch)
    engine.scheduler.land_prefill(batch)
    assert result is not None
    engine._postprocess(batch, result.token_ids, result.logprobs)
    engine.kv.manager.check_invariants(engine.scheduler.running)

    finals: dict[str, RequestOutput] = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    _check_idle(engine)
    outs = [finals[i] for i in ids[1:4]]
    # Each later copy computes at most what is left past the last whole cached page.
    for out in outs:
        assert out.prompt_tokens - out.cached_tokens <= page_size
        assert out.token_ids == reference[tuple(shared)]
    assert finals[ids[4]].token_ids == reference[tuple(unrelated)]


def test_chunked_prefill_copies_wait_for_every_chunk(
    tiny_llama_dir: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    """A long prompt cut into chunks: the copies wait until its last chunk lands, and each
    prefill step computes one chunk (an abort waits for one chunk at most)."""
    engine = _engine(tiny_llama_dir, chunked_prefill_size=16, max_prefill_tokens=256)
    prompt = LONG
    ids = [engine.add_request(prompt, GREEDY) for _ in range(4)]
    finals: dict[str, RequestOutput] = {}
    while engine.has_work:
        batch = engine.scheduler.schedule()
        assert batch is not None
        if not batch.is_decode:
            assert batch.num_tokens <= 16, "copies prefilled the same chunk side by side"
        result = engine.runner.run(batch)
        engine.scheduler.land_prefill(batch)
        if result is not None:  # None: a middle chunk, nothing sampled
            for out in engine._postprocess(batch, result.token_ids, result.logprobs):
                if out.finished:
                    finals[out.request_id] = out
        engine.kv.manager.check_invariants(engine.scheduler.running)
    _check_idle(engine)
    outs = [finals[i] for i in ids]
    assert _computed(outs) == len(prompt) + 3  # once, then one token per later copy
    assert all(out.token_ids == reference[tuple(prompt)] for out in outs)


def test_cache_off_never_waits(
    tiny_llama_dir: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    engine = _engine(tiny_llama_dir, enable_prefix_cache=False)
    prompt = SHARED
    outs = engine.generate([prompt] * 3, GREEDY)
    assert _computed(outs) == 3 * len(prompt)
    assert all(out.token_ids == reference[tuple(prompt)] for out in outs)


def test_tight_kv_budget_still_finishes(
    tiny_llama_dir: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    """A pool that holds barely more than one copy: the copies share, nothing deadlocks."""
    engine = _engine(tiny_llama_dir, kv_cache_tokens=96, max_running_requests=4)
    prompt = SHARED
    outs = engine.generate([prompt] * 4, GREEDY)
    _check_idle(engine)
    assert all(out.token_ids == reference[tuple(prompt)] for out in outs)
    assert _computed(outs) < 4 * len(prompt)


def test_abort_of_the_request_waited_for_releases_the_waiters(
    tiny_llama_dir: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    engine = _engine(tiny_llama_dir, chunked_prefill_size=16)
    prompt = LONG
    first = engine.add_request(prompt, GREEDY)
    later = [engine.add_request(prompt, GREEDY) for _ in range(2)]
    engine.step()  # the first chunk of the first copy; the others wait
    assert engine.abort(first) is not None
    finals = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    _check_idle(engine)
    assert all(finals[i].token_ids == reference[tuple(prompt)] for i in later)


def _first_batch_sizes(model_dir: Path, shared: int, own: int) -> list[int]:
    """Four prompts of ``shared`` common then ``own`` distinct tokens, added at once:
    the number of tokens each admitted request computes in the first prefill batch."""
    (prefix,) = random_prompts([shared], seed=11)
    suffixes = random_prompts([own] * 4, seed=12)
    engine = _engine(model_dir)
    for suffix in suffixes:
        engine.add_request(prefix + suffix, GREEDY)
    batch = engine.scheduler.schedule()
    assert batch is not None and not batch.is_decode
    return list(batch.extend_lens)


@pytest.mark.parametrize(
    ("shared", "own", "waits"),
    [
        (3, 120, False),  # a common first word: computing it again costs less than a step
        (20, 12, True),  # most of each prompt (issue 13's burst): the copies wait
        (40, 200, True),  # MIN_SHARED_TOKENS or more: worth a step whatever the rest
    ],
)
def test_what_a_shared_start_is_worth_waiting_for(
    tiny_llama_dir: Path, shared: int, own: int, waits: bool
) -> None:
    assert MIN_SHARED_TOKENS == 32
    lens = _first_batch_sizes(tiny_llama_dir, shared, own)
    assert lens == ([shared + own] if waits else [shared + own] * 4)


def test_common_prefix_len() -> None:
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len([1, 2, 3], [2, 2, 3]) == 0
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.randrange(3) for _ in range(rng.randrange(12))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(5))]
        expected = 0
        while expected < min(len(a), len(b)) and a[expected] == b[expected]:
            expected += 1
        assert common_prefix_len(a, b) == expected
