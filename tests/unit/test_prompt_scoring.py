"""Prompt scoring against HF transformers: every prompt token's logprob given its prefix,
its rank and the top alternatives, whatever the prefix cache holds and however the
prompt is chunked."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import Engine, SamplingParams
from engine.request import TokenLogprob
from tests.conftest import make_tiny_model
from tests.unit.cpu_engine import checked_engine

ATOL = 1e-4  # float32 engine against float32 HF
TOP = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> tuple[Path, Any]:
    path = make_tiny_model(tmp_path_factory.mktemp("scoring"), default_model_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return path, hf_model


def hf_prompt_logprobs(hf_model: Any, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt) - 1, vocab]`` log-softmax of HF's logits at positions 0..P-2."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(dim=-1)


def assert_matches_hf(hf_model: Any, prompt: list[int], scored: list[TokenLogprob | None]) -> None:
    expected = hf_prompt_logprobs(hf_model, prompt)
    assert len(scored) == len(prompt)
    assert scored[0] is None  # the first token has no prefix to be scored against
    for pos, entry in enumerate(scored[1:]):
        assert entry is not None
        row = expected[pos]
        assert entry.token_id == prompt[pos + 1]
        assert entry.logprob == pytest.approx(row[prompt[pos + 1]].item(), abs=ATOL)
        # Ties within float noise may fall either way (the distribution is flat).
        target = row[prompt[pos + 1]]
        assert entry.rank is not None
        assert int((row > target + ATOL).sum()) < entry.rank <= int((row > target - ATOL).sum()) + 1
        values, ids = row.topk(TOP)
        assert list(entry.top) == ids.tolist()
        assert list(entry.top.values()) == pytest.approx(values.tolist(), abs=ATOL)


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(length)] for _ in range(count)]


def scoring(max_tokens: int = 2) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=TOP
    )


def test_scored_prompt_matches_hf_over_chunks(tiny: tuple[Path, Any]) -> None:
    path, hf_model = tiny
    # Chunks of 8 against prompts of 13..29 tokens: scoring spans several prefill steps.
    engine = checked_engine(path, chunked_prefill_size=8, kv_cache_tokens=512)
    batch = [p[:n] for p, n in zip(prompts(3, 29, seed=1), (29, 13, 21))]
    outs = engine.generate(batch, scoring())
    for prompt, out in zip(batch, outs, strict=True):
        assert out.prompt_logprobs is not None
        assert_matches_hf(hf_model, prompt, out.prompt_logprobs)
        assert len(out.token_ids) == 2


def test_cached_prefix_is_recomputed_and_shared(tiny: tuple[Path, Any]) -> None:
    path, hf_model = tiny
    engine = checked_engine(path, kv_cache_tokens=512)
    prompt = prompts(1, 24, seed=2)[0]
    plain = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.generate([prompt], plain)  # the prompt's KV now sits in the prefix cache
    out = engine.generate([prompt], scoring())[0]
    assert out.cached_tokens == 0  # it computed the whole prompt: logits are not cached
    assert out.prompt_logprobs is not None
    assert_matches_hf(hf_model, prompt, out.prompt_logprobs)
    # A scored prompt lands in the cache like any other: a fresh prompt sharing it hits.
    fresh = prompts(1, 30, seed=3)[0]
    engine.generate([fresh], scoring())
    again = engine.generate([[*fresh, 7, 8]], plain)[0]
    assert again.cached_tokens >= len(fresh) - 1


def test_max_tokens_zero_scores_without_generating(tiny: tuple[Path, Any]) -> None:
    path, hf_model = tiny
    engine = checked_engine(path, kv_cache_tokens=512)
    prompt = prompts(1, 17, seed=4)[0]
    out = engine.generate([prompt], scoring(max_tokens=0))[0]
    assert out.token_ids == [] and out.text == ""
    assert out.finish_reason == "length"
    assert out.prompt_logprobs is not None
    assert_matches_hf(hf_model, prompt, out.prompt_logprobs)


def test_scoring_next_to_generation_in_mixed_batches(tiny: tuple[Path, Any]) -> None:
    """Scoring prompts join running decodes (mixed batches); generation is unchanged."""
    path, hf_model = tiny
    engine = checked_engine(path, kv_cache_tokens=1024, enable_mixed_batches=True)
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    gen_prompt, *scored = prompts(3, 20, seed=5)
    alone = engine.generate([gen_prompt], plain)[0].token_ids
    engine.flush_cache()
    engine.add_request(gen_prompt, plain, request_id="gen")
    engine.step()  # its prefill: it decodes from now on
    for k, prompt in enumerate(scored):
        engine.add_request(prompt, scoring(max_tokens=0), request_id=f"s{k}")
    finals = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert engine.scheduler.num_mixed_steps > 0
    assert finals["gen"].token_ids == alone
    assert finals["gen"].prompt_logprobs is None
    for k, prompt in enumerate(scored):
        scored_lp = finals[f"s{k}"].prompt_logprobs
        assert scored_lp is not None
        assert_matches_hf(hf_model, prompt, scored_lp)


def test_max_tokens_zero_needs_prompt_scoring(tiny: tuple[Path, Any]) -> None:
    engine: Engine = checked_engine(tiny[0], kv_cache_tokens=256)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_request([5, 6, 7], SamplingParams(prompt_logprobs=21))
