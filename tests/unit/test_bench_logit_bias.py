"""hiserve-bench --logit-bias: the JSON object reaches every request's payload as given;
a malformed one is a usage error that says what is wrong."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import bench.__main__ as bench_main
from bench.client import CompletionClient
from bench.workloads import WorkloadConfig, generate

ARGV = ["run", "--base-url", "http://127.0.0.1:1", "--workload", "random", "--num-prompts", "2"]


def _client_kwargs(monkeypatch: pytest.MonkeyPatch, *extra: str) -> dict[str, Any]:
    """The CompletionClient arguments ``main`` builds from the command line (nothing sent)."""
    seen: dict[str, Any] = {}

    def fake_run(state: Any, workload: Any, options: Any, **client_kwargs: Any) -> None:
        seen.update(client_kwargs)

    monkeypatch.setattr(bench_main, "run_blocking", fake_run)
    bench_main.main([*ARGV, "--no-progress", *extra])
    return seen


def _payloads(kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    client = CompletionClient("http://127.0.0.1:1", **kwargs)
    try:
        requests = generate(WorkloadConfig(workload="random", num_prompts=2)).requests
        return [client._payload(r) for r in requests]
    finally:
        asyncio.run(client.aclose())


def test_logit_bias_reaches_every_payload(monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs = _client_kwargs(monkeypatch, "--logit-bias", '{"2": -100, "50256": 5.5}')
    assert kwargs["logit_bias"] == {"2": -100.0, "50256": 5.5}
    for payload in _payloads(kwargs):
        assert payload["logit_bias"] == {"2": -100.0, "50256": 5.5}
        assert payload["ignore_eos"] is True


def test_no_logit_bias_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs = _client_kwargs(monkeypatch)
    assert kwargs["logit_bias"] is None
    assert all("logit_bias" not in payload for payload in _payloads(kwargs))


@pytest.mark.parametrize("text", ["{2: -100}", "[2]", '{"2": "low"}', '{"2": true}'])
def test_malformed_logit_bias_is_a_usage_error(
    text: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench_main, "run_blocking", lambda *a, **k: pytest.fail("ran"))
    assert bench_main.main([*ARGV, "--logit-bias", text]) == bench_main.EXIT_USAGE
    assert "--logit-bias must be a JSON object" in capsys.readouterr().err
