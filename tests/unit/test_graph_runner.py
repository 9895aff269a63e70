"""The decode graph runner's static path on the CPU (``api=None``: "capture" is a direct
call of the captured function on the static buffers): greedy output equal to the eager
engine's through batches and contexts that cross buckets, requests finishing, joining,
retracted and aborted; exact slot accounting; the dummy rows writing only the dummy
slot; and a captured step that reads no tensor on the host and keeps its shapes."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine import Engine, SamplingParams
from engine.graph_runner import (
    DecodeGraphRunner,
    batch_buckets,
    bucket_for,
    context_buckets,
)
from engine.model_runner import StepInputs
from tests.unit.test_engine import engine_for

BACKENDS = ("torch", "cpu_native")
MIN_CONTEXT = 16  # small context buckets, so short test conversations cross several


class HostReads(TorchFunctionMode):
    """Records what a captured device graph cannot contain: reading a tensor's values on
    the host (which also syncs), and every op with its output shapes (a replay repeats the
    captured ops on the captured shapes, so these must not depend on the step)."""

    HOST_READS = frozenset(
        ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")
        + ("nonzero", "unique", "masked_select", "argwhere", "unique_consecutive")
    )

    def __init__(self) -> None:
        super().__init__()
        self.host_reads: list[str] = []
        self.ops: list[tuple[str, tuple[tuple[int, ...], ...]]] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        name = getattr(func, "__name__", str(func))
        if name in self.HOST_READS:
            self.host_reads.append(name)
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        shapes = tuple(tuple(o.shape) for o in outs if isinstance(o, torch.Tensor))
        self.ops.append((name, shapes))
        return out


class CheckedReplay:
    """Wraps one bucket's graph: every replay is traced (host reads, op shapes) and the
    KV slots it changed are recorded."""

    def __init__(self, inner: Any, runner: CheckedRunner, key: tuple[int, int]) -> None:
        self.inner, self.runner, self.key = inner, runner, key

    def replay(self) -> None:
        kv = self.runner.kv_pool.kv_buffer
        before = kv.clone()
        with HostReads() as trace:
            self.inner.replay()
        changed = (kv != before).flatten(3).any(-1).any(0).any(0)  # [num_slots]
        self.runner.written.append(set(changed.nonzero().flatten().tolist()))
        self.runner.traces.setdefault(self.key, []).append(trace)


class CheckedRunner(DecodeGraphRunner):
    """The static path, recording each step: rows, bucket, slots written, traces."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[tuple[int, tuple[int, int], list[int]]] = []  # (B, key, out slots)
        self.written: list[set[int]] = []
        self.traces: dict[tuple[int, int], list[HostReads]] = {}

    def capture(self, batch: int, context: int) -> Any:
        checked = CheckedReplay(super().capture(batch, context), self, (batch, context))
        self.graphs[(batch, context)] = checked
        return checked

    def run(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        out_slots, seq_lens = args[2], args[4]
        logits = super().run(*args, **kwargs)
        assert logits is not None
        key = self.bucket_of(seq_lens)
        assert key is not None
        self.steps.append((len(seq_lens), key, out_slots.tolist()))
        assert logits.shape[0] == len(seq_lens)  # the padded rows' logits are dropped
        assert torch.isfinite(self._logits[: key[0]]).all()  # the padded rows too
        return logits


def with_graphs(engine: Engine) -> CheckedRunner:
    runner = CheckedRunner(
        engine.model,
        engine.kv.device_pool,
        engine.kv.req_table,
        engine.device,
        engine.config.max_running_requests,
        min_context_bucket=MIN_CONTEXT,
    )
    engine.runner.graphs = runner
    return runner


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def scripted_run(engine: Engine, seed: int = 0) -> dict[str, list[int]]:
    """Requests that join in waves (batches of 1, 3, 6, 11: several buckets), run for
    different lengths (contexts past 16, 32, 64 and 128), and two aborted mid-decode.
    Returns each request's final tokens (what it had when aborted)."""
    rng = random.Random(seed)
    # step -> prompt lengths of the requests that join then (short ones first, so the
    # longest context grows through every bucket)
    joins = {0: [5], 4: [8, 12], 9: [20, 30, 3], 15: [60, 70, 10, 40, 25]}
    aborts = {20: "r2", 31: "r6"}  # step -> request aborted before it
    finished: dict[str, list[int]] = {}
    step, count = 0, 0
    while step <= max(joins) or engine.has_work:
        for length in joins.get(step, []):
            rid = f"r{count}"
            max_tokens = 200 if rid in aborts.values() else rng.randrange(8, 40)
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            engine.add_request(_prompt(rng, length), params, rid)
            count += 1
        if step in aborts:
            out = engine.abort(aborts[step])
            assert out is not None, f"{aborts[step]} was meant to be running"
            finished[out.request_id] = out.token_ids
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
        step += 1
    assert len(finished) == count
    return finished


def accounting(engine: Engine) -> dict[str, float]:
    stats = engine.stats()
    keys = ("kv_free", "kv_used", "kv_cached", "running", "waiting", "retractions_total")
    return {k: stats[k] for k in keys}


def check_steps(runner: CheckedRunner) -> None:
    """Every replay wrote exactly its rows' slots (and, when padded, the dummy slot 0)."""
    assert runner.steps and len(runner.steps) == len(runner.written)
    for (rows, (batch, _), out_slots), written in zip(runner.steps, runner.written):
        assert 0 not in out_slots
        expected = set(out_slots) | ({0} if rows < batch else set())
        # A padded row writes slot 0; its K/V may equal what slot 0 already held.
        assert written - {0} == set(out_slots) and written <= expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_static_path_matches_eager_across_buckets(tiny_llama_dir: Path, backend: str) -> None:
    eager = engine_for(tiny_llama_dir, attention_backend=backend, max_running_requests=16)
    expected = scripted_run(eager)
    graphed = engine_for(tiny_llama_dir, attention_backend=backend, max_running_requests=16)
    runner = with_graphs(graphed)
    got = scripted_run(graphed)
    assert got == expected
    assert accounting(graphed) == accounting(eager)
    check_steps(runner)
    batches = {key[0] for _, key, _ in runner.steps}
    contexts = {key[1] for _, key, _ in runner.steps}
    assert {1, 4, 8, 16} <= batches, batches  # 3 -> 4, 6 -> 8, 11 -> 16: padded
    if backend == "cpu_native":  # reads the pool in place: graphs keyed by batch only
        assert runner.in_place and contexts == {graphed.kv.req_table.max_context}
    else:  # the gather fallback pads each row's K/V to a context bucket
        assert not runner.in_place and {16, 32, 64, 128} <= contexts, contexts
    assert any(rows < key[0] for rows, key, _ in runner.steps)
    # Every pure decode step was replayed: a step that went eager would be missing here.
    assert len(runner.steps) == sum(runner.replays.values())


def test_captured_step_reads_nothing_on_the_host_and_keeps_its_shapes(
    tiny_llama_dir: Path,
) -> None:
    engine = engine_for(tiny_llama_dir, attention_backend="torch", max_running_requests=16)
    runner = with_graphs(engine)
    scripted_run(engine)
    repeated = {key: traces for key, traces in runner.traces.items() if len(traces) > 1}
    assert repeated
    for key, traces in repeated.items():
        assert all(not t.host_reads for t in traces), (key, traces[0].host_reads)
        # Different steps (lengths, rows, slots) of one bucket: the same ops and shapes.
        assert all(t.ops == traces[0].ops for t in traces[1:]), key


def test_host_reads_detector_sees_a_host_read() -> None:
    with HostReads() as trace:
        torch.ones(3).sum().item()
    assert trace.host_reads == ["item"]


def test_retraction_with_graphs_matches_eager(tiny_llama_dir: Path) -> None:
    def run(graphs: bool) -> tuple[dict[str, list[int]], dict[str, float], Engine]:
        # A pool this small cannot hold every request's output: decode must retract.
        engine = engine_for(tiny_llama_dir, kv_cache_tokens=160, max_prefill_tokens=64)
        engine.scheduler.new_token_ratio = 0.0
        if graphs:
            with_graphs(engine)
        return scripted_run(engine, seed=3), accounting(engine), engine

    expected, eager_accounting, eager = run(graphs=False)
    got, graph_accounting, graphed = run(graphs=True)
    assert eager.scheduler.num_retractions > 0
    assert got == expected and graph_accounting == eager_accounting
    assert isinstance(graphed.runner.graphs, CheckedRunner)
    check_steps(graphed.runner.graphs)


def test_steps_outside_the_buckets_run_eagerly(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager = engine_for(tiny_llama_dir, max_running_requests=16)
    expected = scripted_run(eager)
    engine = engine_for(tiny_llama_dir, max_running_requests=16)
    runner = with_graphs(engine)
    runner.batch_buckets = [1, 2]  # as if --cuda-graph-max-bs 2
    runner.max_graphs = 1
    eager_decodes: list[int] = []
    real_forward = engine.runner.forward

    def forward(inputs: Any, kv_loads: list[Any]) -> Any:
        if inputs.is_decode:
            eager_decodes.append(len(inputs.req_rows))
        return real_forward(inputs, kv_loads)

    monkeypatch.setattr(engine.runner, "forward", forward)
    got = scripted_run(engine)
    assert got == expected
    assert list(runner.graphs) == [(1, runner.context_buckets[0])] and runner.steps
    assert all(rows <= 2 for rows, _, _ in runner.steps)
    assert any(rows > 2 for rows in eager_decodes)  # past the largest batch bucket
    # Batches of 1-2 in a context bucket that found the cap full went eager too.
    assert any(rows <= 2 for rows in eager_decodes)


def test_mixed_and_prefill_steps_stay_eager(tiny_llama_dir: Path) -> None:
    engine = engine_for(tiny_llama_dir)
    runner = with_graphs(engine)
    engine.add_request(_prompt(random.Random(1), 30), SamplingParams(max_tokens=1))
    engine.step()  # the prefill samples the only token: no decode step at all
    assert not engine.has_work and not runner.steps and not runner.graphs


# ---- buckets ------------------------------------------------------------------------------


def test_batch_buckets() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]
    big = batch_buckets(300)
    assert big[-3:] == [256, 288, 300] and big == sorted(set(big))


def test_context_buckets_and_lookup() -> None:
    assert context_buckets(1024, 256) == [256, 512, 1024]
    assert context_buckets(1000, 256) == [256, 512, 1000]
    assert context_buckets(100, 256) == [100]
    buckets = context_buckets(1000, 256)
    assert [bucket_for(n, buckets) for n in (1, 256, 257, 999, 1000)] == [256, 256, 512, 1000, 1000]
    assert bucket_for(1001, buckets) is None


class LoadToWaitFor:
    """A host-tier load the eager forward waits for, layer by layer (already landed)."""

    def wait_layer(self, layer_id: int) -> None:
        pass


def test_only_plain_decode_steps_replay(tiny_llama_dir: Path) -> None:
    engine = engine_for(tiny_llama_dir)
    runner = with_graphs(engine)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    for n in (4, 7):
        engine.add_request(_prompt(random.Random(n), n), params)
    engine.step()  # the prefill
    batch = engine.scheduler.schedule()
    assert batch is not None and batch.is_decode
    inputs, _ = engine.runner.step_inputs(batch)
    assert not engine.runner._replays(inputs, eager_only=True)  # a host-tier load to wait for
    one_sampling = dataclasses.replace(inputs, sample_ends=inputs.sample_ends[:1])
    assert not engine.runner._replays(one_sampling, eager_only=False)  # a row not sampling
    assert engine.runner._replays(inputs, eager_only=False)
    assert not runner.steps
    # A tensor-parallel worker takes the path rank 0 took: eager, or the graph.
    engine.runner.follow(inputs, [LoadToWaitFor()])
    assert not runner.steps
    engine.runner.follow(dataclasses.replace(inputs, replay=True), [])
    assert len(runner.steps) == 1
    # A worker without mixed graphs told to replay one fails.
    mixed = dataclasses.replace(inputs, replay=True, is_decode=False)
    with pytest.raises(RuntimeError, match="mixed graph of 2 tokens that this rank cannot"):
        engine.runner.follow(mixed, [])
    # One it cannot replay (more rows than its largest graph) fails, never runs eagerly:
    # rank 0's padded graph and an eager forward would all-reduce different shapes.
    rows = runner.max_batch + 1
    too_many = dataclasses.replace(
        inputs, replay=True, prefix_lens=[1] * rows, req_rows=list(range(rows))
    )
    with pytest.raises(RuntimeError, match=f"graph of {rows} rows that this rank cannot"):
        engine.runner.follow(too_many, [])
    assert len(runner.steps) == 1
    # Rank 0 decides and sends the decision with the step.
    sent: list[StepInputs] = []
    engine.runner.on_step = sent.append
    assert engine.runner.run(batch) is not None
    assert len(sent) == 1 and sent[0].replay and len(runner.steps) == 2
