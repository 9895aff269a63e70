"""bench.step_budget: both scenarios and the batch's throughput on every budget, and the
short request's latency counted from its arrival (the step in progress then included)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench import step_budget
from engine import Engine, EngineConfig, RequestOutput


def test_every_scenario_and_budget_gets_a_row(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    step_budget.main(
        [
            "--model",
            str(tiny_llama_dir),
            "--budgets",
            "none",
            "50",
            "--reps",
            "1",
            "--long-len",
            "100",
            "--short-tokens",
            "2",
            "--arrive-after",
            "0",
            "--batch",
            "3",
            "--batch-prompt-len",
            "20",
            "30",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:6]]
    assert [(r[0], r[1]) for r in rows] == [
        ("arrives", "none"),
        ("arrives", "50"),
        ("running", "none"),
        ("running", "50"),
    ]
    assert all(r[3] == "1.00" for r in rows if r[1] == "none")
    assert lines[6].startswith("batch of 3, prompts 20-30 tokens")
    batch = [line.split() for line in lines[7:]]
    assert [(r[0], r[1], r[3]) for r in batch] == [
        ("batch", "none", "tok/s"),
        ("batch", "50", "tok/s"),
    ]
    assert float(batch[0][2]) > 0 and batch[0][4] == "1.00"


def test_the_wait_for_the_step_in_progress_counts(tiny_llama_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", kv_cache_tokens=1024))
    try:
        step = engine.step

        def slow_step() -> list[RequestOutput]:
            time.sleep(0.3)
            return step()

        engine.step = slow_step  # type: ignore[method-assign]
        longs = [step_budget._prompt(50, 1)]
        short_s, _ = step_budget.run_once(engine, "arrives", longs, [5, 6, 7], 1, 0.05)
        # it arrived 0.05 s into a 0.3 s step: it waits for that step's end, then its own
        assert short_s >= 0.25 + 0.3, short_s
    finally:
        engine.close()
