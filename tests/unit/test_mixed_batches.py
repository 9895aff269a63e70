"""Mixed batches through the engine: decodes and prefill chunks in one forward, HF parity,
exact KV accounting, and the alternating scheduler behind --disable-mixed-batches."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.request import RequestOutput
from tests.unit.mixed_log import StepLog, StepRecord, run_waves
from tests.unit.test_engine import engine_for, hf_greedy

PARAMS = SamplingParams(max_tokens=10, temperature=0)
BACKENDS = ("torch", "cpu_native")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def arrival_waves() -> list[tuple[int, list[list[int]]]]:
    """Short prompts first; while they decode, a long prompt (chunked) and two prompts that
    extend the first ones (prefix hits); then one that shares the long prompt's start."""
    rng = random.Random(15)
    first = [_tokens(rng, n) for n in (6, 10, 14)]
    long_prompt = _tokens(rng, 70)
    return [
        (0, first),
        (3, [long_prompt, first[0] + _tokens(rng, 5), first[1] + _tokens(rng, 3)]),
        (6, [long_prompt[:40] + _tokens(rng, 9)]),
    ]


def expected_ids(waves: list[tuple[int, list[list[int]]]]) -> dict[str, list[int]]:
    return {f"w{k}p{i}": p for k, (_, ps) in enumerate(waves) for i, p in enumerate(ps)}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> dict[str, list[int]]:
    prompts = expected_ids(arrival_waves())
    outs = hf_greedy(tiny_llama_dir, list(prompts.values()), PARAMS.max_tokens)
    return dict(zip(prompts, outs))


def check_sampled_rows(steps: list[StepRecord]) -> None:
    """The sampler got exactly the decodes and the chunks that end a prompt, in batch
    order, and the LM head ran on those rows only."""
    for step in steps:
        assert step.sampled == [rid for rid, _, _, samples in step.seqs if samples]
        assert step.logits_rows == len(step.sampled)
        assert all(samples for _, _, _, samples in step.seqs[: step.num_decodes])


def run_arrivals(model_dir: Path, **overrides: object) -> tuple[dict[str, list[int]], StepLog]:
    eng = engine_for(model_dir, chunked_prefill_size=8, max_prefill_tokens=20, **overrides)
    log = StepLog(eng)
    outs = run_waves(eng, arrival_waves(), PARAMS)
    stats = eng.stats()
    assert stats["kv_used"] == 0 and stats["running"] == 0
    assert stats["kv_free"] + stats["kv_cached"] == stats["kv_total"]
    assert stats["mixed_steps_total"] == len(log.mixed_steps)
    return {rid: o.token_ids for rid, o in outs.items()}, log


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_arrivals_while_decoding_match_hf(tiny_llama_dir, reference, backend, page_size):
    outs, log = run_arrivals(tiny_llama_dir, attention_backend=backend, page_size=page_size)
    assert outs == reference
    assert len(log.mixed_steps) >= 3
    check_sampled_rows(log.steps)
    # Every step decodes every request that is ready to decode: nobody waits a step.
    for step in log.steps:
        assert step.decode_ready <= set(step.decode_ids)
    # A non-final chunk of the long prompt rode along with decodes and sampled nothing.
    assert any(
        not samples and n > 1
        for step in log.mixed_steps
        for _, _, n, samples in step.seqs[step.num_decodes :]
    )
    # Prefix hits were admitted into mixed steps: their first chunk starts past zero.
    hit_starts = {
        rid: start
        for step in log.mixed_steps
        for rid, start, _, _ in step.seqs[step.num_decodes :]
        if rid in ("w1p1", "w1p2")
    }
    assert set(hit_starts) == {"w1p1", "w1p2"} and min(hit_starts.values()) > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_disabled_alternates_prefill_and_decode(tiny_llama_dir, reference, backend):
    outs, log = run_arrivals(tiny_llama_dir, attention_backend=backend, enable_mixed_batches=False)
    assert outs == reference
    assert not log.mixed_steps
    check_sampled_rows(log.steps)
    # Prefill steps made ready requests wait a step, but never two steps in a row.
    waited = [i for i, s in enumerate(log.steps) if s.prefill_only and s.decode_ready]
    assert waited
    for i in waited:
        assert not log.steps[i + 1].prefill_only


def test_retraction_inside_a_mixed_step(tiny_llama_dir):
    rng = random.Random(1)
    waves = [
        (0, [_tokens(rng, 6), _tokens(rng, 8), _tokens(rng, 5)]),
        (4, [_tokens(rng, 30)]),  # chunked while the others decode and run out of KV
        (8, [_tokens(rng, 7)]),
    ]
    params = SamplingParams(max_tokens=24, temperature=0)
    eng = engine_for(
        tiny_llama_dir, kv_cache_tokens=64, chunked_prefill_size=8, max_prefill_tokens=16
    )
    eng.scheduler.new_token_ratio = 0.0  # admit greedily so that decode must retract
    log = StepLog(eng)
    outs = run_waves(eng, waves, params)  # invariants checked after every step
    retracting = [s for s in log.mixed_steps if s.retracted]
    assert retracting, "no step retracted and prefilled at once; the scenario drifted"
    for step in retracting:
        # The request just retracted is not admitted again in the same step.
        assert not set(step.retracted) & {rid for rid, *_ in step.seqs}
    check_sampled_rows(log.steps)
    prompts = expected_ids(waves)
    want = hf_greedy(tiny_llama_dir, list(prompts.values()), params.max_tokens)
    assert [outs[rid].token_ids for rid in prompts] == want


def test_aborts_inside_mixed_steps(tiny_llama_dir, reference):
    aborted: dict[str, RequestOutput] = {}

    def abort_some(step: int, eng) -> None:
        running = {r.request_id: r for r in eng.scheduler.running}
        long_req = running.get("w1p0")
        # The long prompt mid-prefill, after it rode in a mixed step; then a decoder.
        mid_prefill = long_req is not None and 8 < long_req.kv_len < long_req.seq_len - 8
        if mid_prefill and "w1p0" not in aborted:
            aborted["w1p0"] = eng.abort("w1p0")
        if step == 7 and "w0p2" in running:
            assert running["w0p2"].output_ids  # decoding
            aborted["w0p2"] = eng.abort("w0p2")

    eng = engine_for(tiny_llama_dir, chunked_prefill_size=8, max_prefill_tokens=20)
    log = StepLog(eng)
    outs = run_waves(eng, arrival_waves(), PARAMS, between=abort_some)
    assert set(aborted) == {"w1p0", "w0p2"}
    assert any("w1p0" in {rid for rid, *_ in s.seqs} for s in log.mixed_steps)
    for rid, want in reference.items():
        if rid in aborted:
            assert rid not in outs and aborted[rid].finish_reason == "abort"
            assert aborted[rid].token_ids == want[: len(aborted[rid].token_ids)]
        else:
            assert outs[rid].token_ids == want
    stats = eng.stats()
    assert stats["kv_used"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
    assert stats["kv_free"] + stats["kv_cached"] == stats["kv_total"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_host_tier_load_back_inside_a_mixed_step(tiny_llama_dir, backend):
    rng = random.Random(2)
    first = [_tokens(rng, 40) for _ in range(3)]
    second = [_tokens(rng, 40) for _ in range(3)]
    # The second group pushes the first off the device pool (into the host tier); the
    # first group's prompts come back, extended, while the second group decodes.
    waves = [
        (0, first),
        (12, second),
        (16, [first[0] + _tokens(rng, 8), first[1] + _tokens(rng, 8)]),
    ]
    eng = engine_for(
        tiny_llama_dir,
        attention_backend=backend,
        kv_cache_tokens=160,
        enable_hierarchical_cache=True,
        hicache_ratio=8,
        hicache_load_threshold=4,
        chunked_prefill_size=32,
        max_prefill_tokens=64,
    )
    log = StepLog(eng)
    outs = run_waves(eng, waves, PARAMS)
    for rid in ("w2p0", "w2p1"):
        assert outs[rid].cached_tokens_host == 40  # loaded back, not recomputed
        assert log.first_steps()[rid].is_mixed
    assert eng.stats()["loadback_tokens_total"] == 80
    eng.kv.manager.tree.check_host_invariants()  # type: ignore[attr-defined]
    prompts = expected_ids(waves)
    want = hf_greedy(tiny_llama_dir, list(prompts.values()), PARAMS.max_tokens)
    assert [outs[rid].token_ids for rid in prompts] == want


def test_decodes_filling_the_budget_fall_back_to_alternating(tiny_llama_dir):
    rng = random.Random(4)
    waves = [(0, [_tokens(rng, 3), _tokens(rng, 4), _tokens(rng, 5)]), (8, [_tokens(rng, 6)])]
    # Three decodes fill a budget of three tokens: a mixed step would leave no room for
    # the late prompt, so it would wait until the others finish; alternating serves it.
    eng = engine_for(tiny_llama_dir, chunked_prefill_size=3, max_prefill_tokens=3)
    log = StepLog(eng)
    outs = run_waves(eng, waves, PARAMS)
    assert not any(s.is_mixed and len(s.decode_ready) >= 3 for s in log.steps)
    late = log.first_steps()["w1p0"]
    assert late.prefill_only and len(late.decode_ready) == 3
    prompts = expected_ids(waves)
    want = hf_greedy(tiny_llama_dir, list(prompts.values()), PARAMS.max_tokens)
    assert [outs[rid].token_ids for rid in prompts] == want
