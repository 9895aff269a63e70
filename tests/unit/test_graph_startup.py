"""Graphs captured at start-up (engine/graph_startup.py) without a device: every batch
size captured largest first and checked against eager before serving, nothing captured
while serving, a mismatch or a failed capture turning graphs off before serving (the
reason logged), and a failed capture never leaving the backend capturing."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, SamplingParams, graph_startup, platform
from engine.graph_runner import DecodeGraphRunner
from engine.graph_setup import DIRECT_GRAPHS_ENV, build_decode_graphs
from tests.unit.fake_backends import FakeStreamBackend
from tests.unit.test_engine import engine_for
from tests.unit.test_graph_capture import FakeGraph, FakeGraphBackend

PARAMS = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)


def prompts() -> list[list[int]]:
    return [[100 + 7 * i + j for j in range(n)] for i, n in enumerate((5, 9, 3, 12, 6))]


class RecordingRunner(DecodeGraphRunner):
    """The CPU static path (direct calls), recording the order of captures."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.captured: list[int] = []

    def capture(self, batch: int, context: int) -> Any:
        self.captured.append(batch)
        return super().capture(batch, context)


def runner_for(engine: Any, cls: type[DecodeGraphRunner] = RecordingRunner) -> Any:
    return cls(engine.model, engine.kv.device_pool, engine.kv.req_table, engine.device, 8)


def test_every_batch_size_is_captured_largest_first_then_served_without_capture(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    expected = [o.token_ids for o in engine_for(tiny_llama_dir).generate(prompts(), PARAMS)]
    engine = engine_for(tiny_llama_dir)  # auto: the native kernel reads the pool in place
    runner = runner_for(engine)
    assert runner.in_place and len(runner.context_buckets) == 1
    with caplog.at_level(logging.INFO):
        assert graph_startup.capture_at_start(runner) is None
    assert runner.captured == [8, 4, 2, 1]
    assert "captured 4 batch sizes" in caplog.text and "checked against eager" in caplog.text
    # The check's dummy rows and slots left no trace in the accounting.
    assert engine.kv.req_table.free_rows == engine.kv.req_table.max_rows
    runner.captured_at_start = True
    engine.runner.graphs = runner
    got = [o.token_ids for o in engine.generate(prompts(), PARAMS)]
    assert got == expected
    assert runner.captured == [8, 4, 2, 1]  # nothing captured while serving
    assert sum(runner.replays.values()) >= PARAMS.max_tokens - 1
    assert {batch for batch, _ in runner.replays} <= {1, 2, 4, 8}


class WrongReplay(RecordingRunner):
    """A "graph" whose replay computes something else than the eager step."""

    def capture(self, batch: int, context: int) -> Any:
        graph = super().capture(batch, context)
        real = graph.replay

        def replay() -> None:
            real()
            self._logits[:batch] += 0.5

        graph.replay = replay
        return graph


def test_a_replay_that_differs_from_eager_is_caught(tiny_llama_dir: Path) -> None:
    engine = engine_for(tiny_llama_dir)
    runner = runner_for(engine, WrongReplay)
    reason = graph_startup.capture_at_start(runner)
    assert reason is not None and "batch 8" in reason and "differ from eager by 0.5" in reason
    assert runner.captured == [8]  # stopped at the first mismatch
    # Without the check the same runner would have served wrong logits.
    assert graph_startup.capture_at_start(runner_for(engine, WrongReplay), check=False) is None


def _musa_build(engine: Any, **overrides: Any) -> DecodeGraphRunner | None:
    config = EngineConfig(model="unused", max_running_requests=4, **overrides)
    musa = platform.DeviceSpec("musa", 0)
    return build_decode_graphs(config, engine.model, engine.kv, musa, engine.device)


def test_graphs_that_do_not_replay_turn_off_before_serving(
    tiny_llama_dir: Path, fake_musa: FakeStreamBackend, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeGraphBackend(fake_musa)  # replay() does nothing: the logits stay zero
    engine = engine_for(tiny_llama_dir)
    with caplog.at_level(logging.WARNING):
        assert _musa_build(engine) is None
    assert len(fake.captures) == 1  # the largest batch, then the check failed
    assert "device graphs: off" in caplog.text and "differ from eager" in caplog.text


class CaptureBreaksMidway:
    """torch.<backend>.graph whose exit fails the way a real invalidated capture does:
    the backend is left capturing on the capture stream."""

    def __init__(self, backend: FakeStreamBackend) -> None:
        self.backend = backend
        self.capturing = False
        self.ended: list[str] = []
        self.set_streams: list[str] = []
        backend.is_current_stream_capturing = lambda: self.capturing
        backend.set_stream = self.set_stream
        backend.MUSAGraph = self.graph_cls
        backend.graph = self.graph
        backend.graph_pool_handle = lambda: "pool"

    def graph_cls(self) -> Any:
        breaker = self

        class Graph(FakeGraph):
            def capture_end(self) -> None:
                breaker.ended.append("capture_end")
                breaker.capturing = False

        return Graph()

    def set_stream(self, stream: Any) -> None:
        self.set_streams.append(stream.name)
        self.backend.active[stream.device] = stream

    @contextlib.contextmanager
    def graph(self, graph: Any, **options: Any) -> Iterator[None]:
        capture_stream = self.backend.Stream()
        self.backend.active[0] = capture_stream  # entered, never left
        self.capturing = True
        yield
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_never_leaves_the_backend_capturing(
    tiny_llama_dir: Path, fake_musa: FakeStreamBackend, caplog: pytest.LogCaptureFixture
) -> None:
    breaker = CaptureBreaksMidway(fake_musa)
    engine = engine_for(tiny_llama_dir)
    main = fake_musa.current_stream(0)
    with caplog.at_level(logging.WARNING):
        assert _musa_build(engine) is None
    assert "capturing batch 4 failed" in caplog.text and "not permitted" in caplog.text
    assert breaker.ended == ["capture_end"] and not breaker.capturing
    assert fake_musa.current_stream(0) is main and breaker.set_streams == [main.name]
    assert ("synchronize", 0) in fake_musa.log
    # Serving then runs eagerly and correctly.
    expected = [o.token_ids for o in engine_for(tiny_llama_dir).generate(prompts(), PARAMS)]
    assert [o.token_ids for o in engine.generate(prompts(), PARAMS)] == expected


def test_gather_fallback_keeps_lazy_context_buckets(
    tiny_llama_dir: Path, fake_musa: FakeStreamBackend
) -> None:
    fake = FakeGraphBackend(fake_musa)
    engine = engine_for(tiny_llama_dir, attention_backend="torch")
    runner = _musa_build(engine)
    assert runner is not None and not runner.in_place and not runner.captured_at_start
    assert len(runner.context_buckets) > 1 and fake.captures == []
    assert torch.equal(runner._logits, torch.zeros_like(runner._logits))


class OtherRank:
    """``gather`` of a two-rank tensor-parallel group seen from rank 0: rank 1 answers
    ``answers`` in turn; ``calls`` records what this rank shared."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = list(answers)
        self.calls: list[Any] = []

    def __call__(self, value: Any) -> list[Any]:
        self.calls.append(value)
        return [value, self.answers.pop(0)]


def test_tensor_parallel_ranks_stop_together_at_the_first_failure_of_any(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = engine_for(tiny_llama_dir)
    other = OtherRank([True, False])  # rank 1 captures batch 8, then its check fails
    runner = runner_for(engine)
    reason = graph_startup.capture_at_start(runner, gather=other)
    assert reason == "tensor-parallel rank 1 failed the replay check of batch 8 (its log says why)"
    assert runner.captured == [8] and other.calls == [True, True]
    # This rank's own failure is its reason, shared at the same point.
    other = OtherRank([True, True])
    reason = graph_startup.capture_at_start(runner_for(engine, WrongReplay), gather=other)
    assert reason is not None and "differ from eager" in reason
    assert other.calls == [True, False]
    # Both well: every size, a capture and a check each, in the same order on both ranks.
    other = OtherRank([True] * 8)
    runner = runner_for(engine)
    with caplog.at_level(logging.INFO):
        assert graph_startup.capture_at_start(runner, gather=other) is None
    assert runner.captured == [8, 4, 2, 1] and other.calls == [True] * 8
    assert "in lockstep with the other tensor-parallel ranks" in caplog.text


def test_tensor_parallel_ranks_capture_the_same_sizes_or_none(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    engine = engine_for(tiny_llama_dir)  # the native kernel reads the pool in place
    config = EngineConfig(model="unused", max_running_requests=4, tensor_parallel_size=2)
    cpu = platform.DeviceSpec("cpu")

    def build(other: OtherRank) -> DecodeGraphRunner | None:
        return build_decode_graphs(config, engine.model, engine.kv, cpu, engine.device, other)

    other = OtherRank([None])  # no graph API on the CPU: eager on every rank
    assert build(other) is None and other.calls == [None]
    monkeypatch.setenv(DIRECT_GRAPHS_ENV, "1")  # the graph path, "replays" called directly
    other = OtherRank([[1, 2, 4]] + [True] * 6)
    runner = build(other)
    assert runner is not None and runner.api is None and runner.captured_at_start
    assert sorted(batch for batch, _ in runner.graphs) == [1, 2, 4]
    assert other.calls == [[1, 2, 4]] + [True] * 6
    # A rank that cannot capture (it logs why), or would capture other sizes: none does.
    for answer in (None, [1, 2]):
        other = OtherRank([answer])
        with caplog.at_level(logging.WARNING):
            assert build(other) is None
        assert f"the tensor-parallel ranks would capture [[1, 2, 4], {answer}]" in caplog.text
        assert other.calls == [[1, 2, 4]]
