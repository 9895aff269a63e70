"""Mixed batches by default: on where decode runs eagerly, off where decode steps replay
device graphs (an H200 measured a graphed decode step faster than an eager mixed one),
and what an operator asks for wins either way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import engine.build as engine_module
from engine import Engine, SamplingParams
from engine.graph_runner import DecodeGraphRunner
from server.args import parse_args
from tests.unit.test_engine import engine_for


def _direct_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine gets a graph runner in its direct-call mode (the CPU has no graphs), as
    it would on cuda or musa."""

    def build(
        config: Any, model: Any, kv: Any, spec: Any, device: Any, gather: Any = None
    ) -> DecodeGraphRunner:
        return DecodeGraphRunner(model, kv.device_pool, kv.req_table, device, 8)

    monkeypatch.setattr(engine_module, "build_decode_graphs", build)


def _waves(engine: Engine) -> dict[str, Any]:
    """Two requests decode while a third arrives: a mixed scheduler mixes it in."""
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = [engine.add_request([5 + i, 9, 11, 13], greedy) for i in range(2)]
    while any(not engine.requests[r].output_ids for r in first):
        engine.step()
    engine.add_request([7, 8, 9, 10, 11, 12], greedy)
    while engine.has_work:
        engine.step()
    return engine.stats()


@pytest.mark.parametrize(
    ("graphs", "asked", "mixed"),
    [
        (False, None, True),  # CPU default: mixed
        (True, None, False),  # graphed decode: alternate
        (True, True, True),  # --no-disable-mixed-batches wins
        (False, False, False),  # --disable-mixed-batches wins
    ],
)
def test_default_follows_device_graphs(
    tiny_llama_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    graphs: bool,
    asked: bool | None,
    mixed: bool,
) -> None:
    if graphs:
        _direct_graphs(monkeypatch)
    engine = engine_for(tiny_llama_dir, enable_mixed_batches=asked)
    try:
        assert (engine.runner.graphs is not None) is graphs
        assert engine.scheduler.mixed is mixed
        assert engine.health()["mixed_batches"] is mixed
        stats = _waves(engine)
        assert (stats["mixed_steps_total"] > 0) is mixed
    finally:
        engine.close()


def test_flag_is_three_way() -> None:
    assert parse_args([], environ={}).engine.enable_mixed_batches is None
    assert parse_args(["--disable-mixed-batches"], environ={}).engine.enable_mixed_batches is False
    forced = parse_args(["--no-disable-mixed-batches"], environ={})
    assert forced.engine.enable_mixed_batches is True
    env = parse_args([], environ={"HISERVE_DISABLE_MIXED_BATCHES": "false"})
    assert env.engine.enable_mixed_batches is True
