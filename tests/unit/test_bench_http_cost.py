"""bench.http_cost: the offline and served runs of one workload, and its failure modes."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import http_cost
from bench.client import RequestResult
from bench.runner import RunState
from engine import RequestOutput


def test_served_and_offline_runs_of_one_workload(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    http_cost.main(
        [
            "--model",
            str(tiny_llama_dir),
            "--num-prompts",
            "4",
            "--input-len",
            "16",
            "--output-len",
            "3",
            "--max-concurrency",
            "4",
            "--startup-timeout",
            "120",
            "--rounds",
            "2",
        ]
    )
    out = capsys.readouterr().out
    rounds = re.findall(r"round (\d): offline +[\d.]+ output tok/s, served \(HTTP\) +[\d.]+", out)
    assert rounds == ["1", "2"]
    assert "served/offline, median of 2: " in out
    assert f"(goal >= {100 * http_cost.GOAL:.0f}%)" in out
    assert re.search(r"server event-loop thread: [\d.]+ us of CPU per output token", out)
    assert "per-token serving work: detokenize" in out


def test_each_round_has_its_own_prompts() -> None:
    args = argparse.Namespace(seed=0, num_prompts=2, input_len=8, output_len=2)
    first, second = (http_cost.make_workload(args, r) for r in range(2))
    assert [r.prompt for r in first.requests] != [r.prompt for r in second.requests]
    assert [r.prompt for r in first.requests] == [
        r.prompt for r in http_cost.make_workload(args, 0).requests
    ]


def test_thread_cpu_reads_the_main_threads_time() -> None:
    before = http_cost.thread_cpu_s(os.getpid())
    assert before is not None
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # this (main) thread's own work
        pass
    after = http_cost.thread_cpu_s(os.getpid())
    assert after is not None and after - before >= 0.2
    assert http_cost.thread_cpu_s(2**22 + 12345) is None  # no such process


def test_process_cpu_counts_the_process_and_its_children() -> None:
    burn = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass"
    before = http_cost.process_cpu_s(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", burn + "\ninput()"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        spent = 0.0
        while spent < 0.3 and time.monotonic() < deadline:  # its CPU while it is alive
            now = http_cost.process_cpu_s(os.getpid())
            assert before is not None and now is not None
            spent = now[1] - before[1]
            time.sleep(0.05)
        assert 0.3 <= spent < 5
    finally:
        child.communicate(b"\n")
    own = http_cost.process_cpu_s(os.getpid())
    assert own is not None and own[0] >= (http_cost.thread_cpu_s(os.getpid()) or 0)
    assert http_cost.process_cpu_s(2**22 + 12345) is None


def test_a_failed_served_run_is_not_reported_as_a_rate() -> None:
    state = RunState("served", "http://127.0.0.1:1", 2)
    state.start_time, state.end_time = 0.0, 1.0
    good = RequestResult(0, 0, 0, 8)
    good.ok, good.output_tokens = True, 3
    bad = RequestResult(1, 1, 0, 8)
    bad.ok, bad.error = False, "HTTP 500"
    state.results = [good]
    assert http_cost.served_tokens_per_s(state) == 3.0
    state.results = [good, bad]
    with pytest.raises(RuntimeError, match="HTTP 500"):
        http_cost.served_tokens_per_s(state)


def test_per_token_cost_replays_every_token(default_model_dir: Path) -> None:
    from engine.loader import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir)
    prompts = [tokenizer.encode("Hello there"), tokenizer.encode("The sea is")]
    outputs = [tokenizer.encode(" general Kenobi!"), tokenizer.encode(" deep and blue.")]
    cost = http_cost.per_token_cost(tokenizer, prompts, outputs)
    assert cost.detokenize_us > 0 and cost.sse_chunk_us > 0


def test_the_offline_run_keeps_the_served_runs_concurrency(tiny_llama_dir: Path) -> None:
    # It handed every prompt to the engine at once: 3 prompts at one in flight were a
    # batch of 3 offline against one stream served.
    from bench.workloads import WorkloadConfig, generate
    from engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", kv_cache_tokens=1024))
    try:
        config = WorkloadConfig(workload="random", num_prompts=3, input_len=12, output_len=4)
        workload = generate(config)
        running: list[int] = []
        step = engine.step

        def counted() -> list[RequestOutput]:
            running.append(int(engine.stats()["running"]) + int(engine.stats()["waiting"]))
            return step()

        engine.step = counted  # type: ignore[method-assign]
        rate, outputs = http_cost.offline_tokens_per_s(engine, workload, max_concurrency=1)
        assert max(running) == 1 and len(running) >= 3 * 4  # one at a time, 4 tokens each
        assert rate > 0 and [len(o) for o in outputs] == [r.max_tokens for r in workload.requests]
        _, outputs = http_cost.offline_tokens_per_s(engine, workload, max_concurrency=3)
        assert [len(o) for o in outputs] == [r.max_tokens for r in workload.requests]
        assert max(running[-3:]) == 3
    finally:
        engine.close()
