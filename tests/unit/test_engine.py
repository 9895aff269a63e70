"""Engine end to end on a tiny random model, with HF transformers as the oracle."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import Engine, SamplingParams
from engine.config import CPU_MAX_PREFILL_TOKENS, default_max_prefill_tokens
from tests.unit.cpu_engine import checked_engine


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for ids in prompts:
        with torch.no_grad():
            seq = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new,
                do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
        new = seq[0, len(ids) :].tolist()
        eos = model.generation_config.eos_token_id
        eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        for i, tok in enumerate(new):
            if tok in eos_ids:
                new = new[: i + 1]
                break
        outs.append(new)
    return outs


def make_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def engine_for(model_dir: Path, **kw) -> Engine:
    eng = checked_engine(model_dir, **{"kv_cache_tokens": 4096, **kw})
    return eng


GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(6)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(tiny_llama_dir, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # everything in one batch
        {"chunked_prefill_size": 5, "max_prefill_tokens": 16},  # chunked prefill
        {"page_size": 4},
        {"enable_prefix_cache": False},
        {"schedule_policy": "lpm", "max_running_requests": 2},
    ],
    ids=["batched", "chunked", "page4", "no-cache", "lpm-2-running"],
)
def test_greedy_matches_hf(tiny_llama_dir, prompts, reference, overrides):
    eng = engine_for(tiny_llama_dir, **overrides)
    outs = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    # Second pass: prefix-cache hits must not change a single token.
    outs2 = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs2] == reference
    # Exact hits: the whole prompt but its last token (computed again for its logits),
    # rounded down to whole pages; nothing at all without the cache.
    page = overrides.get("page_size", 1)
    expected = [
        (len(p) - 1) // page * page if overrides.get("enable_prefix_cache", True) else 0
        for p in prompts
    ]
    assert [o.cached_tokens for o in outs2] == expected
    assert [o.cached_tokens_device for o in outs2] == expected
    stats = eng.stats()
    assert stats["kv_used"] == 0 and stats["running"] == 0
    assert stats["kv_free"] + stats["kv_cached"] == stats["kv_total"]


def test_retraction_keeps_greedy_output(tiny_llama_dir, prompts, reference):
    # A pool this small cannot hold all six requests' outputs at once.
    eng = engine_for(tiny_llama_dir, kv_cache_tokens=96, max_prefill_tokens=64)
    eng.scheduler.new_token_ratio = 0.0  # admit greedily so decode must retract
    outs = eng.generate(prompts, GREEDY)
    assert eng.scheduler.num_retractions > 0
    assert [o.token_ids for o in outs] == reference


def test_a_step_carries_the_device_default_of_prompt_tokens(tiny_llama_dir):
    # Unset, a CPU step carries at most 1,024 prompt tokens: a burst of 3 x 400 takes a
    # second prefill step for the third prompt. Set, the limit is the one given.
    burst = make_prompts(3, seed=11, lo=400, hi=401)
    eng = engine_for(tiny_llama_dir)
    assert eng.scheduler.max_prefill_tokens == CPU_MAX_PREFILL_TOKENS == 1024
    for prompt in burst:
        eng.add_request(prompt, GREEDY)
    eng.step()
    assert [r.kv_len for r in eng.scheduler.running] == [400, 400, 224]
    wide = engine_for(tiny_llama_dir, max_prefill_tokens=2048)
    assert wide.scheduler.max_prefill_tokens == 2048
    assert default_max_prefill_tokens("cuda") == default_max_prefill_tokens("musa") == 4096


def test_shared_prefix_reports_cached_tokens(tiny_llama_dir):
    eng = engine_for(tiny_llama_dir)
    system = make_prompts(1, seed=7, lo=30, hi=31)[0]
    first = eng.generate([system + [500, 501]], GREEDY)[0]
    assert first.cached_tokens == 0
    second = eng.generate([system + [900, 901, 902]], GREEDY)[0]
    assert second.cached_tokens == len(system)
    assert second.cached_tokens_device == len(system) and second.cached_tokens_host == 0


def test_abort_everywhere_releases_kv(tiny_llama_dir):
    eng = engine_for(tiny_llama_dir, chunked_prefill_size=4, max_prefill_tokens=4)
    long_params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    prompts = make_prompts(3, seed=3, lo=20, hi=30)
    ids = [eng.add_request(p, long_params) for p in prompts]
    eng.step()  # first request is mid chunked prefill; the others wait
    reqs = {r.request_id: r for r in eng.scheduler.running}
    waiting = [r.request_id for r in eng.scheduler.waiting]
    assert list(reqs) == [ids[0]] and waiting == ids[1:]
    assert 0 < reqs[ids[0]].kv_len < len(prompts[0])  # prefilling
    assert eng.abort(ids[0]).finish_reason == "abort"
    assert eng.abort(ids[2]).finish_reason == "abort"  # queued
    for _ in range(12):
        eng.step()
    reqs = {r.request_id: r for r in eng.scheduler.running}
    assert list(reqs) == [ids[1]] and not eng.scheduler.waiting
    generated = list(reqs[ids[1]].output_ids)
    assert 0 < len(generated) < 50  # decoding
    out = eng.abort(ids[1])
    assert out is not None and out.finish_reason == "abort" and out.finished
    assert out.token_ids == generated  # what it had generated so far
    assert eng.abort(ids[1]) is None  # already gone
    stats = eng.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_used"] == 0
    assert stats["kv_free"] + stats["kv_cached"] == stats["kv_total"]


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], SamplingParams(), "empty"),
        ([5, 10**6], SamplingParams(), "vocabulary"),
        (list(range(100, 1200)), SamplingParams(), "context length"),
        ([5, 6], SamplingParams(max_tokens=0), "max_tokens"),
        ([5, 6], SamplingParams(top_p=0.0), "top_p"),
        ([5, 6], SamplingParams(top_p=1.5), "top_p"),
        ([5, 6], SamplingParams(stop=[f"s{i}" for i in range(17)]), "stop"),
    ],
)
def test_bad_input_is_a_clear_error_and_engine_keeps_serving(shared_engine, prompt, params, field):
    eng = shared_engine
    with pytest.raises(ValueError, match=field):
        eng.add_request(prompt, params)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    out = eng.generate([[5, 6, 7]], params)[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    assert eng.stats()["running"] == 0 and eng.stats()["waiting"] == 0


@pytest.fixture
def shared_engine(tiny_llama_dir: Path) -> Engine:
    """A fresh engine per test: no state (cached prefixes, sampler seeds) crosses tests."""
    return engine_for(tiny_llama_dir)


def test_stop_conditions(shared_engine, prompts, reference):
    eng = shared_engine
    prompt, ref = prompts[0], reference[0]
    # max_tokens
    out = eng.generate([prompt], SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.token_ids == ref[:3] and out.finish_reason == "length"
    # stop token id: generation ends at (and includes) the first occurrence
    stop_tok = ref[4]
    out = eng.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_tok])
    )[0]
    assert out.token_ids == ref[: ref.index(stop_tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # stop string: the text is cut before it
    full = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    assert len(full.text) > 6, full.text  # else this check would test nothing
    stop = full.text[3:6]
    out = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop=[stop]))[0]
    assert out.text == full.text[: full.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_seeded_sampling_is_reproducible(shared_engine, prompts):
    eng = shared_engine
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = eng.generate([prompts[1]], params)[0].token_ids
    other = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    crowd = eng.generate([prompts[0], prompts[1], prompts[2]], [other, params, other])
    assert crowd[1].token_ids == alone


def test_streamed_deltas_add_up(shared_engine, prompts):
    eng = shared_engine
    rid = eng.add_request(prompts[2], SamplingParams(max_tokens=10, temperature=0))
    text, tokens = "", []
    final = None
    for _ in range(100):  # 10 tokens take far fewer steps; bounded, so a hang fails
        outs = [o for o in eng.step() if o.request_id == rid]
        for o in outs:
            text += o.new_text
            tokens += o.new_token_ids
        if outs and outs[-1].finished:
            final = outs[-1]
            break
    assert final is not None, "the request never finished"
    assert tokens == final.token_ids and text == final.text


def test_top_logprobs_match_hf(shared_engine, tiny_llama_dir, prompts):
    """Chosen-token and top-5 logprobs equal HF's log_softmax of the same logits.

    Tolerance: 1e-4 absolute in float32 (the two implementations sum in different orders).
    """
    from transformers import AutoModelForCausalLM

    eng = shared_engine
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=5, ignore_eos=True)
    out = eng.generate([prompts[3]], params)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    seq = torch.tensor([prompts[3] + out.token_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(seq).logits[0].float(), dim=-1)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for i, entry in enumerate(out.logprobs):
        row = logprobs[len(prompts[3]) - 1 + i]
        assert entry.token_id == out.token_ids[i]
        assert abs(entry.logprob - row[entry.token_id].item()) < 1e-4
        top_vals, top_ids = row.topk(5)
        assert list(entry.top) == top_ids.tolist()
        for tok, val in zip(top_ids.tolist(), top_vals.tolist()):
            assert abs(entry.top[tok] - val) < 1e-4


def test_request_larger_than_the_reserve_still_runs(tiny_llama_dir):
    """A prompt plus max_tokens beyond the pool must not wait forever: it runs alone and
    ends with "length" when the pool is full."""
    eng = engine_for(tiny_llama_dir, kv_cache_tokens=64)
    rid = eng.add_request(list(range(200, 240)), SamplingParams(max_tokens=500, ignore_eos=True))
    final = None
    for _ in range(200):
        final = next((o for o in eng.step() if o.request_id == rid and o.finished), final)
        if final is not None:
            break
    assert final is not None and final.finish_reason == "length"
    assert 0 < len(final.token_ids) <= 64 - 40 + 1
    assert eng.stats()["kv_used"] == 0


@pytest.mark.parametrize("limit", [8, 1])
def test_lpm_admits_longest_cached_prefix_first_unless_queue_is_long(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    from engine import scheduler

    monkeypatch.setattr(scheduler, "LPM_MAX_WAITING", limit)
    eng = engine_for(tiny_llama_dir, schedule_policy="lpm", max_running_requests=1)
    cached = make_prompts(1, seed=5, lo=30, hi=31)[0]
    eng.generate([cached], SamplingParams(max_tokens=1, temperature=0))  # now in the tree
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    first = eng.add_request([7, 8, 9, 10], params)
    hit = eng.add_request([*cached, 11], params)
    eng.step()  # admits one request (max_running_requests=1)
    admitted = [r.request_id for r in eng.scheduler.running]
    # lpm picks the prompt with a 30-token cached prefix; with the queue over the lpm
    # limit (2 waiting > 1) the order is fcfs.
    assert admitted == ([hit] if limit == 8 else [first])
    for _ in range(100):  # two 2-token requests; bounded, so a hang fails
        if not eng.has_work:
            break
        eng.step()
    assert not eng.has_work
