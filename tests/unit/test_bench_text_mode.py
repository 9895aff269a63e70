"""hiserve-bench's text prompts (for routers that refuse token ids) and fleet targets.

The word-level ideal is checked against the default model's real tokenizer: the text
mode's claim is that a shared word prefix is a shared token prefix, and that scaling the
word ideal by the server's token count gives the token-level ideal.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from bench.__main__ import EXIT_USAGE, main
from bench.client import RequestResult
from bench.compare import parse_target
from bench.report import format_table, in_server_tokens
from bench.words import WORDS, text_for, words_for
from bench.workloads import WorkloadConfig, generate, ideal_cached_tokens

TEXT = WorkloadConfig(
    workload="multiturn",
    prompt_mode="text",
    num_clients=3,
    num_rounds=3,
    user_turn_len=12,
    assistant_turn_len=4,
    system_prompt_len=5,
    seed=3,
)


def test_text_mode_sends_the_same_draws_as_words() -> None:
    text = generate(TEXT)
    tokens = generate(WorkloadConfig(**{**TEXT.to_dict(), "prompt_mode": "tokens"}))
    assert [r.prompt for r in text.requests] == [r.prompt for r in tokens.requests]
    assert all(r.text is None for r in tokens.requests)
    for request in text.requests:
        assert request.text is not None
        assert request.text.split(" ") == words_for(request.prompt)
        assert all(word in WORDS for word in request.text.split(" "))
    # a later round starts with the earlier round's whole text, then a space
    by_conversation: dict[int, list[str]] = {}
    for request in text.requests:
        by_conversation.setdefault(request.conversation, []).append(request.text or "")
    for rounds in by_conversation.values():
        for before, after in itertools.pairwise(rounds):
            assert after.startswith(before + " ")


def test_unknown_prompt_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="prompt mode"):
        WorkloadConfig(prompt_mode="bytes")


def test_word_prefixes_are_token_prefixes(default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    workload = generate(TEXT)
    requests = workload.requests
    token_prompts = [tokenizer.encode(r.text, add_special_tokens=False) for r in requests]
    exact = ideal_cached_tokens(token_prompts)
    results = [
        RequestResult(r.index, r.conversation, r.round, len(r.prompt), prompt_tokens=len(t))
        for r, t in zip(requests, token_prompts, strict=True)
    ]
    scaled_results, scaled = in_server_tokens(
        results, ideal_cached_tokens(workload_prompts(workload))
    )
    assert [r.prompt_len for r in scaled_results] == [len(t) for t in token_prompts]
    for estimate, truth in zip(scaled, exact, strict=True):
        assert abs(estimate - truth) <= 1, (estimate, truth)
    # and the total is within a token per request of the truth
    assert abs(sum(scaled) - sum(exact)) <= len(requests)


def workload_prompts(workload: object) -> list[list[int]]:
    return [r.prompt for r in workload.requests]  # type: ignore[attr-defined]


def test_in_server_tokens_scales_and_caps() -> None:
    result = RequestResult(0, 0, 1, prompt_len=10, prompt_tokens=20)
    (scaled,), (ideal,) = in_server_tokens([result], [6])
    assert (scaled.prompt_len, ideal) == (20, 12)
    whole = RequestResult(1, 0, 1, prompt_len=10, prompt_tokens=20)
    assert in_server_tokens([whole], [10])[1] == [19]  # the last token is always computed
    assert result.prompt_len == 10  # the measured result itself is left alone


def test_fleet_targets_parse() -> None:
    target = parse_target("fleet:cache_aware")
    assert (target.label, target.config, target.policy) == (
        "fleet:cache_aware",
        "radix",
        "cache_aware",
    )
    assert parse_target("rr=fleet:round_robin").label == "rr"
    with pytest.raises(ValueError, match="fleet:POLICY"):
        parse_target("fleet:nearest")


def test_fleet_target_needs_text_prompts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--target", "fleet:cache_aware"]) == EXIT_USAGE
    assert "--prompt-mode text" in capsys.readouterr().err


def test_table_shows_the_spread_over_replicas() -> None:
    base = {
        "base_url": "x", "completed": 4, "failed": 0, "not_sent": 0, "duration": 1.0,
        "request_throughput": 4.0, "input_throughput": 1.0, "output_throughput": 1.0,
        "cache_hit_rate": 0.5, "device_hit_rate": None, "host_hit_rate": None,
        "ideal_hit_rate": 0.6, "ttft": {}, "itl": {}, "e2e_latency": {}, "rounds": [],
        "workload": {"workload": "multiturn"},
    }  # fmt: skip
    for stats in ("ttft", "itl", "e2e_latency"):
        base[stats] = {"mean": 0.1, "p50": 0.1, "p90": 0.1, "p99": 0.1}
    routed = {**base, "label": "fleet", "workers": {"http://a": 3, "http://b": 1}}
    alone = {**base, "label": "single", "workers": {}}
    table = format_table([alone, routed])
    row = next(line for line in table.splitlines() if line.startswith("Requests per replica"))
    assert row.split()[-2:] == ["-", "3 / 1"] or row.endswith("3 / 1")
    assert "Requests per replica" not in format_table([alone])


def test_text_for_joins_words() -> None:
    assert text_for([0, 1, len(WORDS)]) == f"{WORDS[0]} {WORDS[1]} {WORDS[0]}"


def test_client_sends_the_text() -> None:
    import asyncio

    from bench.client import CompletionClient

    text_request = generate(TEXT).requests[0]
    token_request = generate(WorkloadConfig(**{**TEXT.to_dict(), "prompt_mode": "tokens"}))
    client = CompletionClient("http://127.0.0.1:1")
    try:
        assert client._payload(text_request)["prompt"] == text_request.text
        assert client._payload(token_request.requests[0])["prompt"] == text_request.prompt
    finally:
        asyncio.run(client.aclose())


def test_router_args_are_checked_by_smg_before_launching(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["compare", "--target", "fleet:cache_aware", "--prompt-mode", "text"]
    assert main([*argv, "--router-arg=--cache-treshold=0.5"]) == EXIT_USAGE
    error = capsys.readouterr().err
    assert "--cache-treshold" in error and "smg refuses" in error
