"""Decode steps replayed from CUDA graphs: greedy tokens equal to eager decode (fp32
through batch buckets, and context buckets with the gather fallback; a bf16 batch), no
host sync in a replayed step, and decode speed with graphs against without for the report.

With in-place attention (Triton, the default on CUDA) graphs are keyed by batch size only
(one context bucket, the request table's width) and all captured at start-up; the gather
fallback (``attention_backend="torch"``) keeps context buckets, captured lazily."""

from __future__ import annotations

import gc
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import Engine, SamplingParams
from engine.graph_runner import DecodeGraphRunner
from tests.gpu.conftest import VOCAB, Figures, forbidding_syncs
from tests.gpu.test_gpu_engine import decode_speed, engine_for, prompts

pytestmark = pytest.mark.cuda


def graphs_of(engine: Engine) -> DecodeGraphRunner:
    runner = engine.runner.graphs
    assert runner is not None, "device graphs are off on CUDA (see the engine's log)"
    assert engine.health()["device_graphs"] is True
    # In place: every batch size captured (and checked) before the first request.
    assert runner.captured_at_start == runner.in_place
    return runner


def ensure_captured(runner: DecodeGraphRunner, seq_lens: list[int]) -> None:
    """The graph of a decode batch with these context lengths captured before it runs:
    the gather fallback captures lazily; in place, every graph exists from start-up."""
    bucket = runner.bucket_of(seq_lens)
    assert bucket is not None
    if bucket not in runner.graphs:
        runner.capture(*bucket)


def replays_of_batch(runner: DecodeGraphRunner, batch: int) -> int:
    """Replays of ``batch``'s graphs, whatever their context bucket."""
    return sum(count for (size, _), count in runner.replays.items() if size == batch)


def staggered(engine: Engine, seed: int) -> list[list[int]]:
    """11 requests that start together (batch bucket 16) and end at different steps
    (buckets 8, 4, 2, 1 on the way down); two of the 248-token prompts cross the
    256-token context bucket of the gather fallback while they decode."""
    rng = random.Random(seed)
    ids = []
    for i in range(11):
        length = 248 if i < 3 else rng.randrange(8, 60)
        prompt = [rng.randrange(3, VOCAB) for _ in range(length)]
        params = SamplingParams(max_tokens=6 + 3 * i, temperature=0, ignore_eos=True)
        ids.append(engine.add_request(prompt, params))
    final: dict[str, list[int]] = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.token_ids
    return [final[i] for i in ids]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fp32_graphs_match_eager_across_buckets(tiny_model_dir: Path, backend: str) -> None:
    options: dict[str, Any] = dict(kv_cache_tokens=4096, attention_backend=backend)
    eager = engine_for(tiny_model_dir, disable_cuda_graph=True, **options)
    assert eager.runner.graphs is None
    expected = staggered(eager, seed=1)
    eager.close()
    engine = engine_for(tiny_model_dir, **options)
    runner = graphs_of(engine)
    assert runner.in_place == (backend == "triton")
    got = staggered(engine, seed=1)
    assert runner.failure is None, runner.failure
    assert got == expected
    batches = {batch for batch, _ in runner.replays}
    contexts = {context for _, context in runner.replays}
    assert {16, 8, 4} <= batches, runner.replays
    if runner.in_place:
        assert contexts == set(runner.context_buckets), runner.replays  # the one bucket
    else:
        assert {256, 512} <= contexts, runner.replays
    stats = engine.stats()
    assert stats["kv_used"] == 0 and stats["kv_free"] + stats["kv_cached"] == stats["kv_total"]
    engine.close()


def test_bf16_decode_batch_with_graphs_matches_eager(tiny_model_dir: Path) -> None:
    # Different lengths: with the gather fallback eager attention masks its padding too
    # (no kernel switch to the unmasked one), so both paths differ only by the context
    # bucket's masked columns; in place, both run the same paged kernel.
    batch = [p[: 12 + 2 * i] for i, p in enumerate(prompts(8, 26, seed=3))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    eager = engine_for(
        tiny_model_dir, dtype="bfloat16", kv_cache_tokens=1024, disable_cuda_graph=True
    )
    expected = [out.token_ids for out in eager.generate(batch, params)]
    eager.close()
    engine = engine_for(tiny_model_dir, dtype="bfloat16", kv_cache_tokens=1024)
    runner = graphs_of(engine)
    got = [out.token_ids for out in engine.generate(batch, params)]
    assert runner.failure is None, runner.failure
    assert got == expected
    assert replays_of_batch(runner, 8) >= 14  # every decode step of the batch replayed
    engine.close()


def test_replayed_steps_never_sync_the_host(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_for(tiny_model_dir, kv_cache_tokens=1024)
    runner = graphs_of(engine)
    ensure_captured(runner, [26] * 3)  # 20-token prompts and 6 new tokens
    real_run = runner.run
    replayed: list[int] = []

    def run(*args: Any, **kwargs: Any) -> torch.Tensor | None:
        # Copy-in and replay only (capturing synchronises, by design). ``resolve``: the
        # overlapped loop's future-token references, swapped on the device.
        if runner.bucket_of(args[4]) not in runner.graphs:
            return real_run(*args, **kwargs)
        logits = forbidding_syncs(real_run, *args, **kwargs)
        replayed.append(len(args[4]))
        return logits

    monkeypatch.setattr(runner, "run", run)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.generate(prompts(3, 20, seed=5), params)
    assert replayed and set(replayed) == {3}
    engine.close()


def test_decode_speed_with_and_without_graphs(small_model_dir: Path, figures: Figures) -> None:
    results: dict[tuple[bool, int], float] = {}
    startup: dict[bool, tuple[float, int]] = {}  # seconds and bytes reserved by the engine
    for graphs in (False, True):  # eager first: it compiles the kernels both runs share
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved()
        start = time.perf_counter()
        engine = engine_for(
            small_model_dir,
            dtype="bfloat16",
            kv_cache_tokens=8192,
            disable_cuda_graph=not graphs,
        )
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        torch.cuda.empty_cache()  # what start-up's eager runs left cached is not the graphs'
        startup[graphs] = (seconds, torch.cuda.memory_reserved() - reserved)
        engine.check_invariants = False  # a timing, not an accounting check
        if graphs:
            runner = graphs_of(engine)
        decode_speed(engine, 4)  # warm-up: kernels, allocator
        for batch in (1, 32):
            tokens_per_s, itl = decode_speed(engine, batch)
            label = "graphs" if graphs else "eager"
            figures.add(
                f"decode batch {batch}, {label}: throughput", round(tokens_per_s, 1), "tok/s"
            )
            figures.add(
                f"decode batch {batch}, {label}: inter-token latency", round(itl * 1e3, 2), "ms"
            )
            results[(graphs, batch)] = tokens_per_s
        if graphs:
            assert runner.failure is None, runner.failure
            assert replays_of_batch(runner, 1) >= 32 and replays_of_batch(runner, 32) >= 32
            sizes = len(runner.graphs)
        engine.close()
        del engine
    figures.add(
        f"start-up time added by graphs ({sizes} graphs captured, each checked)",
        round(startup[True][0] - startup[False][0], 2),
        "s",
    )
    figures.add(
        f"graph memory reserved ({sizes} graphs, shared pool, and their buffers)",
        round((startup[True][1] - startup[False][1]) / 2**20, 1),
        "MiB",
    )
    for batch in (1, 32):
        figures.add(
            f"decode batch {batch}: graphs / eager",
            round(results[(True, batch)] / results[(False, batch)], 2),
            "x",
        )


def mixed_waves(engine: Engine, seed: int) -> list[list[int]]:
    """Streams decoding while others arrive, so steps mix decodes and prefill chunks (a
    long prompt in several), driven by the engine's loop."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = [engine.add_request(p, params) for p in prompts(3, 30, seed=seed)]
    final: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.loop.step():
            if out.finished:
                final[out.request_id] = out.token_ids

    while any(not engine.requests[r].output_ids for r in first):
        step()
    later = [
        engine.add_request([rng.randrange(3, VOCAB) for _ in range(n)], params)
        for n in (5, 200, 41, 17)
    ]
    while engine.loop.has_work:
        step()
    return [final[i] for i in first + later]


def test_fp32_mixed_steps_replay_graphs_and_match_eager(tiny_model_dir: Path) -> None:
    options: dict[str, Any] = dict(
        kv_cache_tokens=4096,
        attention_backend="triton",
        enable_mixed_batches=True,
        max_prefill_tokens=96,
        chunked_prefill_size=64,
    )
    eager = engine_for(tiny_model_dir, disable_cuda_graph=True, **options)
    expected = mixed_waves(eager, seed=4)
    eager.close()
    engine = engine_for(tiny_model_dir, **options)
    mixed = engine.runner.mixed_graphs
    assert mixed is not None, "mixed graphs are off on CUDA (see the engine's log)"
    assert engine.health()["mixed_graphs"] is True
    got = mixed_waves(engine, seed=4)
    assert got == expected
    assert sum(mixed.replays.values()) >= engine.stats()["mixed_steps_total"] > 0
    engine.close()


def test_mixed_replays_never_sync_the_host(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_for(
        tiny_model_dir, kv_cache_tokens=4096, attention_backend="triton",
        enable_mixed_batches=True, max_prefill_tokens=64,
    )  # fmt: skip
    mixed = engine.runner.mixed_graphs
    assert mixed is not None
    real_run = mixed.run
    replayed: list[int] = []

    def run(*args: Any, **kwargs: Any) -> torch.Tensor:
        logits = forbidding_syncs(real_run, *args, **kwargs)
        replayed.append(len(args[0]))
        return logits

    monkeypatch.setattr(mixed, "run", run)
    mixed_waves(engine, seed=6)
    assert replayed
    engine.close()
