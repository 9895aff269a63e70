"""bench.scoring_cost's counts on a tiny Llama: a scoring request forwards each prompt
token once (one prefill) whether or not its prompt is cached, and computes a logit row per
position; a plain request computes one row per prompt and, cached, forwards only the last
token. These counts are the engine's, so the test fails if scoring ever costs a second
prefill or a cached prompt is silently skipped."""

from __future__ import annotations

from pathlib import Path

from bench.scoring_cost import KINDS, run_kind
from engine import Engine, EngineConfig


def test_a_scoring_request_costs_one_prefill_cached_or_not(tiny_llama_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_tokens=1024))
    try:
        prompts = [[100 + i + 7 * j for i in range(40)] for j in range(3)]
        total = sum(len(p) for p in prompts)
        work = {kind: run_kind(engine, kind, prompts)[1] for kind in KINDS}
    finally:
        engine.close()
    assert work["prefill"] == (total, len(prompts))
    assert work["scoring"] == (total, total)
    assert work["scoring, prompt cached"] == (total, total)  # the cache holds no logits
    assert work["prefill, prompt cached"] == (len(prompts), len(prompts))
