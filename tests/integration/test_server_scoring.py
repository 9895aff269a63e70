"""Prompt scoring over HTTP with the official ``openai`` client: ``echo`` with
``logprobs`` (the legacy shape evaluation harnesses read) and vLLM's ``prompt_logprobs``,
checked against HF transformers on the same weights."""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

pytestmark = pytest.mark.slow

ATOL = 1e-3  # float32 server against float32 HF on the 135M model (the tiny-model
# unit tests hold 1e-4)


@pytest.fixture(scope="module")
def hf_model(default_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, torch_dtype=torch.float32).eval()


def hf_logprobs(hf_model: Any, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt) - 1, vocab]``: row i scores prompt token i + 1."""
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


def id_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


def check_legacy(lp: Any, prompt: list[int], expected: torch.Tensor, top: int) -> None:
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i, token in enumerate(prompt[1:], start=1):
        want = expected[i - 1, token].item()
        assert lp.token_logprobs[i] == pytest.approx(want, abs=ATOL)
        entry = lp.top_logprobs[i]
        assert lp.tokens[i] in entry and len(entry) <= top + 1
        assert max(entry.values()) == pytest.approx(expected[i - 1].max().item(), abs=ATOL)


def test_echo_scores_many_prompts_without_generating(
    client: openai.OpenAI, model_name: str, hf_model: Any
) -> None:
    prompts = id_prompts(2, 12, seed=1)
    result = client.completions.create(
        model=model_name, prompt=prompts, max_tokens=0, echo=True, logprobs=2, temperature=0
    )
    assert result.usage is not None and result.usage.completion_tokens == 0
    for choice, prompt in zip(result.choices, prompts, strict=True):
        assert choice.finish_reason == "length"
        lp = choice.logprobs
        assert lp is not None and len(lp.tokens) == len(prompt)
        assert "".join(lp.tokens) == choice.text
        check_legacy(lp, prompt, hf_logprobs(hf_model, prompt), top=2)


def test_streamed_scores_with_n_equal_plain(client: openai.OpenAI, model_name: str) -> None:
    """n=2: one choice scores, both report it; streamed as in one body."""
    prompt = id_prompts(1, 10, seed=2)[0]
    create = partial(
        client.completions.create,
        model=model_name,
        prompt=prompt,
        max_tokens=3,
        n=2,
        echo=True,
        logprobs=1,
        temperature=0,
    )
    plain = create()
    per_choice: dict[int, list[float | None]] = {0: [], 1: []}
    for chunk in create(stream=True):
        for choice in chunk.choices:
            per_choice[choice.index] += choice.logprobs.token_logprobs
    for choice in plain.choices:
        values = choice.logprobs.token_logprobs
        assert len(values) == len(prompt) + 3 and values[0] is None
        assert all(v is not None for v in values[1:])
        assert per_choice[choice.index] == pytest.approx(values, abs=1e-5)
    first, second = (c.logprobs.token_logprobs[: len(prompt)] for c in plain.choices)
    assert first == second  # the same scores, handed from the scoring choice


def test_cached_prompt_scores_like_a_fresh_one(
    client: openai.OpenAI, model_name: str, hf_model: Any
) -> None:
    prompt = id_prompts(1, 16, seed=3)[0]
    client.completions.create(model=model_name, prompt=prompt, max_tokens=1)  # now cached
    again = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=0, echo=True, logprobs=1
    )
    check_legacy(again.choices[0].logprobs, prompt, hf_logprobs(hf_model, prompt), top=1)


def test_vllm_prompt_logprobs(client: openai.OpenAI, model_name: str, hf_model: Any) -> None:
    prompt = id_prompts(1, 9, seed=4)[0]
    result = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    scored = result.choices[0].model_extra["prompt_logprobs"]
    expected = hf_logprobs(hf_model, prompt)
    assert scored[0] is None and len(scored) == len(prompt)
    for i, token in enumerate(prompt[1:], start=1):
        table = scored[i]
        row = expected[i - 1]
        assert str(token) in table and len(table) <= 3
        assert table[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=ATOL)
        assert table[str(token)]["rank"] >= 1
        best = str(int(row.argmax()))
        assert table[best]["rank"] == 1
        assert isinstance(table[best]["decoded_token"], str)
    assert result.choices[0].logprobs is None  # prompt_logprobs alone adds no legacy table


def test_scoring_errors(http: httpx.Client) -> None:
    def error(body: dict[str, Any], path: str = "/v1/completions") -> dict[str, Any]:
        resp = http.post(path, json=body)
        assert resp.status_code == 400, resp.text
        return dict(resp.json()["error"])

    assert error({"prompt": "hi", "max_tokens": 0})["param"] == "max_tokens"
    assert error({"prompt": "hi", "prompt_logprobs": -1})["param"] == "prompt_logprobs"
    over = error({"prompt": "hi", "prompt_logprobs": 21})
    assert over["param"] == "prompt_logprobs" and "--max-logprobs" in over["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1}
    assert error(chat, "/v1/chat/completions")["param"] == "prompt_logprobs"
