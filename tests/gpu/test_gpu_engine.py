"""The engine on a real CUDA device: HF parity, bf16 batches, HiCache policies and page
sizes against the plain radix cache, loads that really overlap, the host tier's
allocation through the engine, and decode speed for the report."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams, host_alloc
from tests.gpu.conftest import VOCAB, Figures
from tests.gpu.test_gpu_host_tier import DoubleRegister, slow_down

pytestmark = pytest.mark.cuda
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def engine_for(model_dir: Path, **overrides: Any) -> Engine:
    config: dict[str, Any] = dict(
        model=str(model_dir), device="cuda", dtype="float32", kv_cache_tokens=128
    )
    config.update(overrides)
    engine = Engine(EngineConfig(**config))
    engine.check_invariants = True
    return engine


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(count)]


def multiturn(engine: Engine, clients: int = 5, rounds: int = 3) -> tuple[list[list[int]], int]:
    """Conversations that come back after the others pushed them off the device; all
    start with the same 16-token system prompt (hit by every request)."""
    rng = random.Random(7)
    system = prompts(1, 16, seed=2)[0]
    convos = [system + convo for convo in prompts(clients, 24, seed=1)]
    outputs, host_hits = [], 0
    for r in range(rounds):
        for c in range(clients):
            if r:
                convos[c] = convos[c] + [rng.randrange(3, VOCAB) for _ in range(8)]
            out = engine.generate([convos[c]], GREEDY)[0]
            outputs.append(out.token_ids)
            host_hits += out.cached_tokens_host
            convos[c] = convos[c] + out.token_ids
    return outputs, host_hits


def test_fp32_greedy_matches_hf(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir).float().cuda().eval()
    engine = engine_for(tiny_model_dir)
    for prompt in prompts(3, 24):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            expect = hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        expected = expect[0, len(prompt) :].tolist()  # HF stops early at eos (id 2)
        got = engine.generate([prompt], GREEDY)[0].token_ids
        assert expected and got[: len(expected)] == expected
    engine.close()


def test_bf16_decode_batch_matches_one_by_one(tiny_model_dir: Path) -> None:
    engine = engine_for(tiny_model_dir, dtype="bfloat16", kv_cache_tokens=1024)
    batch = prompts(8, 20, seed=3)
    together = [out.token_ids for out in engine.generate(batch, GREEDY)]
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in batch]
    assert together == alone
    assert all(len(tokens) == 8 for tokens in together)
    engine.close()


@pytest.fixture(scope="module")
def radix_outputs(tiny_model_dir: Path) -> list[list[int]]:
    engine = engine_for(tiny_model_dir)
    outputs, host_hits = multiturn(engine)
    engine.close()
    assert host_hits == 0
    return outputs


@pytest.mark.parametrize(
    ("policy", "page_size", "layout"),
    [
        ("write_through", 1, "layer_first"),
        ("write_through", 4, "page_first"),
        ("write_through_selective", 1, "layer_first"),
        ("write_through_selective", 4, "layer_first"),
        ("write_back", 1, "page_first"),
        ("write_back", 4, "layer_first"),
    ],
)
def test_hicache_matches_the_radix_cache(
    tiny_model_dir: Path,
    radix_outputs: list[list[int]],
    policy: str,
    page_size: int,
    layout: str,
) -> None:
    engine = engine_for(
        tiny_model_dir,
        enable_hierarchical_cache=True,
        hicache_write_policy=policy,
        hicache_mem_layout=layout,
        hicache_load_threshold=4,
        page_size=page_size,
    )
    health = engine.health()
    assert health["host_alloc_method"] == "host_register" and health["pinned"] is True
    assert health["host_pinned_bytes"] == engine.kv.host_pool.nbytes
    outputs, host_hits = multiturn(engine)
    assert outputs == radix_outputs
    stats = engine.stats()
    assert stats["backup_tokens_total"] > 0
    if policy != "write_through_selective":  # it backs up only what was hit twice
        assert host_hits > 0, "no conversation came back from the host tier"
        assert stats["loadback_tokens_total"] == host_hits
    engine.close()


def test_forward_overlaps_a_slow_load_and_reads_the_right_kv(
    tiny_model_dir: Path, radix_outputs: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_for(tiny_model_dir, enable_hierarchical_cache=True, hicache_load_threshold=4)
    slow_down(engine.kv.host_pool, "load", monkeypatch)
    issued_early: list[bool] = []
    real_run = engine.runner.run

    def run(batch: Any) -> Any:
        if batch.kv_loads:
            issued_early.append(not all(h.done() for h in batch.kv_loads))
        return real_run(batch)

    monkeypatch.setattr(engine.runner, "run", run)
    outputs, host_hits = multiturn(engine)
    assert outputs == radix_outputs
    assert host_hits > 0 and issued_early and all(issued_early)
    engine.close()


def test_failed_register_through_the_engine(
    tiny_model_dir: Path, radix_outputs: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = DoubleRegister()
    real_api = host_alloc._register_api

    def api(kind: str) -> Any:
        return (
            host_alloc._RegisterApi(
                runtime, "cudaHostRegister", "cudaHostUnregister", "cudaGetLastError"
            )
            if real_api(kind) is not None
            else None
        )

    monkeypatch.setattr(host_alloc, "_register_api", api)
    engine = engine_for(tiny_model_dir, enable_hierarchical_cache=True, hicache_load_threshold=4)
    health = engine.health()
    assert health["host_alloc_method"] == "pageable" and health["pinned"] is False
    outputs, host_hits = multiturn(engine)  # no stale CUDA error in any kernel
    runtime.cleanup()  # before close() drops the buffer it registered
    engine.close()
    assert outputs == radix_outputs and host_hits > 0


def test_engine_close_with_backups_in_flight(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_for(tiny_model_dir, enable_hierarchical_cache=True)
    slow_down(engine.kv.host_pool, "backup", monkeypatch)
    engine.generate(prompts(2, 30), GREEDY)
    transfer = engine.kv.manager.tree.transfer  # type: ignore[attr-defined]
    in_flight = [h for h in transfer._in_flight if not h.done()]
    assert in_flight, "the slowed backups had already finished"
    at_release: list[bool] = []
    allocation = engine.kv.host_pool.allocation
    real_release = allocation.release

    def release() -> None:
        at_release.append(all(h.done_event.query() for h in in_flight))
        real_release()

    monkeypatch.setattr(allocation, "release", release)
    engine.close()
    torch.cuda.synchronize()
    assert at_release == [True]


def decode_speed(engine: Engine, batch: int) -> tuple[float, float]:
    """(tokens/s, median inter-token latency in s) over the steps in which all ``batch``
    requests decode together. Only a request's last snapshot carries ``token_ids``, so a
    decode step is told by every request having sampled a token before it. Steps run
    through the engine's loop: plain, each synced and timed alone; overlapped, timed
    from one turn's end to the next with no sync (the next step is on the device then,
    and a sync would undo the overlap)."""
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for prompt in prompts(batch, 32, seed=batch):
        engine.add_request(prompt, params)
    sampled: dict[str, int] = {}
    step_times: list[float] = []
    start = time.perf_counter()
    while engine.loop.has_work:
        if not engine.overlap:
            torch.cuda.synchronize()
            start = time.perf_counter()
        outputs = engine.loop.step()
        if not engine.overlap:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        start = time.perf_counter()
        if len(outputs) == batch and all(sampled.get(o.request_id, 0) for o in outputs):
            step_times.append(elapsed)
        for o in outputs:
            sampled[o.request_id] = sampled.get(o.request_id, 0) + len(o.new_token_ids)
    assert len(step_times) >= 32, f"only {len(step_times)} decode steps held all {batch}"
    return batch * len(step_times) / sum(step_times), statistics.median(step_times)


def test_decode_speed(small_model_dir: Path, figures: Figures) -> None:
    engine = engine_for(small_model_dir, dtype="bfloat16", kv_cache_tokens=8192)
    engine.check_invariants = False  # a timing, not an accounting check
    decode_speed(engine, 4)  # warm-up: kernels, allocator
    for batch in (1, 32):
        tokens_per_s, itl = decode_speed(engine, batch)
        figures.add(f"decode batch {batch}: throughput", round(tokens_per_s, 1), "tok/s")
        figures.add(f"decode batch {batch}: inter-token latency", round(itl * 1e3, 2), "ms")
        assert tokens_per_s > 0
    engine.close()
