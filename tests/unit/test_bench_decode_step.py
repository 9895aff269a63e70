"""bench.decode_step on a tiny Llama: a round per line, and no round of a batch that waited."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import decode_step
from engine import Engine, EngineConfig


def test_each_round_times_its_prefill_and_decode_steps(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--kv-cache-dtype", "auto"]
    # 3 x 400 prompt tokens: more than a CPU step takes by default, so the bench must
    # ask for the whole batch's prefill in its first step (else it refuses the run).
    decode_step.main([*argv, "--batch", "3", "--prompt-len", "400", "--output-len", "4"])
    rounds = [line for line in capsys.readouterr().out.splitlines() if line.startswith("round")]
    assert len(rounds) == 2
    pattern = (
        r"round \d: prefill (\d+) ms, decode step median ([\d.]+) ms "
        r"\(p90 ([\d.]+)\), ([\d.]+) output tok/s"
    )
    for line in rounds:
        match = re.fullmatch(pattern, line)
        assert match, line
        median, p90, rate = (float(v) for v in match.groups()[1:])
        assert 0 < median <= p90 and rate > 0


def test_round_counts_every_token_and_step(tiny_llama_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", kv_cache_tokens=4096))
    try:
        prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]  # no shared prefix
        r = decode_step.run_round(engine, prompts, output_len=5)
    finally:
        engine.close()
    assert r.output_tokens == 15
    assert len(r.decode_steps_s) == 4  # one prefill step, then one decode step a token
    assert r.total_s >= r.prefill_s + sum(r.decode_steps_s)


def test_a_batch_whose_prefill_takes_two_steps_is_refused(tiny_llama_dir: Path) -> None:
    engine = Engine(
        EngineConfig(
            model=str(tiny_llama_dir), device="cpu", kv_cache_tokens=4096, max_prefill_tokens=8
        )
    )
    try:
        with pytest.raises(RuntimeError, match=r"only \d of 3 requests are decoding"):
            decode_step.run_round(engine, [[5 + i, 6, 7, 8, 9] for i in range(3)], output_len=5)
    finally:
        engine.close()


def test_a_batch_that_waits_for_kv_room_is_refused(tiny_llama_dir: Path) -> None:
    # 1,024 tokens of KV against 4 requests that may each write 1,000: admission keeps
    # half of that in reserve per request, so only some run at once.
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", kv_cache_tokens=1024))
    try:
        with pytest.raises(RuntimeError, match=r"only \d of 4 requests are decoding"):
            decode_step.run_round(engine, [[5 + i, 6, 7, 8] for i in range(4)], output_len=1000)
    finally:
        engine.close()
