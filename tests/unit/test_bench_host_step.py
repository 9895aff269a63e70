"""bench.micro.host_step on a tiny Llama: the no-work model stands in for the forward, and
the parts timed are inside the step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from bench.micro import host_step
from engine import Engine, EngineConfig, SamplingParams


def test_no_work_model_keeps_the_loaded_model_and_varies_its_logits(tiny_llama_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", kv_cache_tokens=4096))
    try:
        inner = engine.runner.model
        stub = host_step.NoWorkModel(inner, rows=4)
        assert stub.config is inner.config  # everything else is the loaded model's
        assert stub(torch.zeros(3, dtype=torch.int64)).shape == (3, 8)
        first = stub.compute_logits(torch.zeros(2, 8))
        second = stub.compute_logits(torch.zeros(2, 8))
        assert first.shape == (2, host_step.LOGIT_IDS) and not torch.equal(first, second)
    finally:
        engine.close()


def test_every_timed_step_decodes_the_whole_batch(tiny_llama_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", kv_cache_tokens=4096))
    steps: list[int] = []
    step = engine.step

    def counted() -> list:
        outs = step()
        steps.append(len(outs))
        return outs

    engine.step = counted  # type: ignore[method-assign]
    try:
        r = host_step.measure(engine, batch=3, steps=4, rounds=2)
    finally:
        engine.close()
    assert steps.count(3) >= 2 * 4  # each timed step gave every request a token
    assert set(r) == {"step", *host_step.PARTS}
    assert 0 < sum(r[p] for p in host_step.PARTS) <= r["step"]


def test_prints_a_line_per_batch(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host_step.main(
        ["--model", str(tiny_llama_dir), "--batches", "1", "2", "--steps", "3", "--rounds", "2"]
    )
    lines = capsys.readouterr().out.splitlines()[2:]
    assert [line.split()[0] for line in lines] == ["1", "2"]
    for line in lines:
        step, schedule, run, post, per_request = (float(v) for v in line.split()[1:])
        assert re.fullmatch(r"\s*\d+(\s+[\d.]+){5}", line), line
        assert schedule + run + post <= step + 3  # whole microseconds, rounded
        assert per_request == pytest.approx(step / int(line.split()[0]), abs=0.6)


def test_the_no_work_server_patches_every_engine_it_builds(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench.micro import no_work_server

    monkeypatch.setattr(Engine, "__init__", Engine.__init__)  # restored after the test
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    no_work_server.patch_engine()
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", kv_cache_tokens=1024))
    try:
        assert isinstance(engine.runner.model, host_step.NoWorkModel)
        out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        assert len(out.token_ids) == 3 and max(out.token_ids) < host_step.LOGIT_IDS
    finally:
        engine.close()
