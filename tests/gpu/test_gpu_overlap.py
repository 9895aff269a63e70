"""The overlapped loop on CUDA: the same tokens as the plain loop (graphs and eager), a
launched decode step that never makes the host wait for the device, and for the report
the inter-token latency at batch 1 and 32 with the loop overlapped and plain (issue 28's
goal: batch 32 within 1.3x of batch 1)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from engine import SamplingParams
from engine.scheduled_batch import ScheduledBatch
from engine.step_loop import LaunchedStep
from tests.gpu.conftest import VOCAB, Figures, forbidding_syncs
from tests.gpu.test_gpu_engine import decode_speed, engine_for, multiturn, prompts
from tests.gpu.test_gpu_graphs import ensure_captured

pytestmark = pytest.mark.cuda


def mixed_params(count: int) -> list[SamplingParams]:
    """Greedy and seeded rows of different lengths, with EOS and a stop token allowed."""
    params = []
    for i in range(count):
        if i % 2:
            params.append(SamplingParams(max_tokens=5 + 3 * i, temperature=0.8, seed=i))
        else:
            params.append(
                SamplingParams(max_tokens=5 + 3 * i, temperature=0, stop_token_ids=[VOCAB // 2])
            )
    return params


def outputs(**config: Any) -> list[tuple[Any, ...]]:
    engine = engine_for(Path(config.pop("model_dir")), kv_cache_tokens=2048, **config)
    rng = random.Random(3)
    batch = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(8, 60))] for _ in range(11)]
    outs = engine.generate(batch, mixed_params(len(batch)))
    engine.close()
    return [(o.token_ids, o.finish_reason, o.stop_reason) for o in outs]


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_overlapped_equals_plain(tiny_model_dir: Path, graphs: bool) -> None:
    common = dict(model_dir=tiny_model_dir, disable_cuda_graph=not graphs)
    plain = outputs(disable_overlap_schedule=True, **common)
    assert outputs(disable_overlap_schedule=False, **common) == plain


def test_overlapped_hicache_equals_plain(tiny_model_dir: Path) -> None:
    hicache = dict(enable_hierarchical_cache=True, hicache_ratio=4)
    plain = engine_for(tiny_model_dir, disable_overlap_schedule=True, **hicache)
    over = engine_for(tiny_model_dir, disable_overlap_schedule=False, **hicache)
    assert over.overlap
    assert multiturn(over) == multiturn(plain)
    plain.close()
    over.close()


def test_launching_a_decode_step_never_waits(tiny_model_dir: Path) -> None:
    engine = engine_for(tiny_model_dir, kv_cache_tokens=1024, disable_overlap_schedule=False)
    runner = engine.runner.graphs
    assert engine.overlap and runner is not None
    ensure_captured(runner, [28] * 3)  # 20-token prompts and 8 new tokens
    real_launch = engine.launch
    checked: list[int] = []

    def launch(batch: ScheduledBatch, keep_future: bool = False) -> LaunchedStep:
        if not (batch.is_decode and any(r.future_ids for r in batch.reqs)):
            return real_launch(batch, keep_future)
        step = forbidding_syncs(real_launch, batch, keep_future)
        checked.append(len(batch.reqs))
        return step

    engine.launch = launch  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.generate(prompts(3, 20, seed=5), params)
    assert checked and set(checked) == {3}
    engine.close()


def test_decode_speed_overlapped_and_plain(small_model_dir: Path, figures: Figures) -> None:
    for overlap in (False, True):
        engine = engine_for(
            small_model_dir, dtype="bfloat16", kv_cache_tokens=8192,
            disable_overlap_schedule=not overlap,
        )  # fmt: skip
        assert engine.overlap == overlap
        engine.check_invariants = False  # a timing, not an accounting check
        decode_speed(engine, 4)  # warm-up
        itl = {}
        label = "overlapped" if overlap else "plain"
        for batch in (1, 32):
            tokens_per_s, itl[batch] = decode_speed(engine, batch)
            figures.add(f"loop {label}, batch {batch}: throughput", round(tokens_per_s, 1), "tok/s")
            figures.add(
                f"loop {label}, batch {batch}: inter-token latency",
                round(itl[batch] * 1e3, 3),
                "ms",
            )
        figures.add(
            f"loop {label}: inter-token latency batch 32 / batch 1 (goal <= 1.3)",
            round(itl[32] / itl[1], 2),
            "x",
        )
        engine.close()
