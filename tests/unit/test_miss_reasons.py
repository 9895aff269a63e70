"""Miss reasons through the engine: each reason driven on purpose, exact counts.

The expected counts come from the workload itself (prompt lengths, page size, what was
sent before and flushed), never from the engine's own bookkeeping; every output is also
checked against the invariant ``cached (every tier) + reasons == prompt tokens``.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import replace
from pathlib import Path

import pytest

from engine import Engine, SamplingParams
from engine.kvcache.miss_reasons import MISS_REASONS, MissReasons
from engine.request import RequestOutput
from tests.unit.cpu_engine import checked_engine
from tests.unit.test_l3_engine import make_engine, stall_file_store

PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(length)]


def reasons(out: RequestOutput) -> dict[str, int]:
    """The non-zero reasons of ``out``, after checking they add up with its cached tokens."""
    missed = out.cache_miss_reasons
    assert out.cached_tokens + missed.total == out.prompt_tokens
    assert out.cached_tokens == (
        out.cached_tokens_device + out.cached_tokens_host + out.cached_tokens_storage
    )
    return {name: n for name, n in missed.as_dict().items() if n}


def run(engine: Engine, prompt_ids: list[int]) -> RequestOutput:
    return engine.generate([prompt_ids], PARAMS)[0]


def test_a_fresh_prompt_is_never_seen_and_its_last_token_below_page(
    tiny_llama_dir: Path,
) -> None:
    engine = checked_engine(tiny_llama_dir, kv_cache_tokens=256)
    first = prompt(40, seed=1)
    assert reasons(run(engine, first)) == {"never_seen": 39, "below_page": 1}
    # The same prompt again: all but the last token cached; that one is always computed.
    again = run(engine, first)
    assert again.cached_tokens == 39 and reasons(again) == {"below_page": 1}
    # A continuation: its new tokens were never seen.
    longer = run(engine, first + prompt(10, seed=2))
    assert longer.cached_tokens == 40  # all of ``first`` (its output continues otherwise)
    assert reasons(longer) == {"never_seen": 50 - 40 - 1, "below_page": 1}
    engine.close()


def test_a_prompt_after_a_flush_was_evicted(tiny_llama_dir: Path) -> None:
    engine = checked_engine(tiny_llama_dir, kv_cache_tokens=256)
    first, other = prompt(40, seed=3), prompt(30, seed=4)
    run(engine, first)
    assert engine.flush_cache()
    assert reasons(run(engine, first)) == {"evicted": 39, "below_page": 1}
    # Evicted up to where the cached run ended, never seen past it.
    mixed = run(engine, other)
    assert reasons(mixed) == {"never_seen": 29, "below_page": 1}
    assert engine.flush_cache()
    grown = run(engine, first + prompt(8, seed=5))
    # ``first`` was cached and flushed; the new tokens after it never were.
    assert reasons(grown) == {"evicted": 40, "never_seen": 47 - 40, "below_page": 1}
    engine.close()


def test_lru_eviction_under_pressure_is_evicted(tiny_llama_dir: Path) -> None:
    """A pool too small for two prompts: the first one's pages go to make room."""
    engine = checked_engine(tiny_llama_dir, kv_cache_tokens=96)
    first, second = prompt(60, seed=6), prompt(60, seed=7)
    run(engine, first)
    run(engine, second)  # needs 61 slots of 96: most of ``first`` is evicted
    out = run(engine, first)
    got = reasons(out)
    assert got.get("never_seen", 0) == 0
    assert got["evicted"] == 59 - out.cached_tokens and got["below_page"] == 1
    assert engine.kv.manager.tree.evicted_device_tokens > 0
    engine.close()


@pytest.mark.parametrize("length", [40, 48, 49, 33])
def test_page_size_floor_is_below_page(tiny_llama_dir: Path, length: int) -> None:
    engine = checked_engine(tiny_llama_dir, kv_cache_tokens=256, page_size=16)
    tokens = prompt(length, seed=8)
    cacheable = (length - 1) // 16 * 16
    assert reasons(run(engine, tokens)) == {
        k: v for k, v in {"never_seen": cacheable, "below_page": length - cacheable}.items() if v
    }
    again = run(engine, tokens)
    assert again.cached_tokens == cacheable
    assert reasons(again) == {"below_page": length - cacheable}
    engine.close()


def test_a_short_host_hit_is_not_loaded(tiny_llama_dir: Path) -> None:
    """A host hit shorter than --hicache-load-threshold is recomputed: not_loaded."""
    engine = checked_engine(
        tiny_llama_dir,
        kv_cache_tokens=128,
        page_size=4,
        enable_hierarchical_cache=True,
        hicache_load_threshold=64,
    )
    tokens = prompt(41, seed=9)
    run(engine, tokens)
    tree = engine.kv.manager.tree
    tree.wait_backups()
    tree.evict(tree.cached_tokens)  # device copies gone: the prefix lives on the host only
    out = run(engine, tokens)
    assert out.cached_tokens == 0
    assert reasons(out) == {"not_loaded": 40, "below_page": 1}
    engine.close()


@pytest.mark.parametrize("slow", ["exists_prefix", "get_into"])
def test_a_store_slower_than_the_deadline_is_storage_timeout(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slow: str
) -> None:
    tokens = prompt(41, seed=10)
    writer = make_engine(tiny_llama_dir, tmp_path)
    run(writer, tokens)
    writer.close()  # every page is in the store
    release = stall_file_store(monkeypatch, slow)
    reader = make_engine(tiny_llama_dir, tmp_path, hicache_storage_prefetch_policy="best_effort")
    out = run(reader, tokens)
    assert out.cached_tokens == 0
    assert reasons(out) == {"storage_timeout": 40, "below_page": 1}
    release.set()
    # The store answers again (the backoff cut short): the same prompt is now a device hit.
    reader.kv.manager.tree.storage._down_until = 0.0
    assert reasons(run(reader, tokens)) == {"below_page": 1}
    reader.close()


def test_a_restart_reads_from_the_store_and_misses_nothing_else(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    tokens = prompt(41, seed=11)
    writer = make_engine(tiny_llama_dir, tmp_path)
    run(writer, tokens)
    writer.close()
    reader = make_engine(tiny_llama_dir, tmp_path)
    out = run(reader, tokens)
    assert out.cached_tokens_storage == 40 and reasons(out) == {"below_page": 1}
    reader.close()


def test_engine_counters_sum_the_reasons(tiny_llama_dir: Path) -> None:
    engine = checked_engine(tiny_llama_dir, kv_cache_tokens=256)
    tokens = prompt(40, seed=12)
    outs = [run(engine, tokens)]
    engine.flush_cache()
    outs.append(run(engine, tokens))
    total = sum((o.cache_miss_reasons for o in outs), MissReasons())
    for reason in MISS_REASONS:
        assert engine.counters[f"prompt_tokens_missed_{reason}_total"] == getattr(total, reason)
    assert engine.counters["prompt_tokens_missed_never_seen_total"] == 39
    assert engine.counters["prompt_tokens_missed_evicted_total"] == 39
    engine.close()


@pytest.mark.parametrize("hicache", [False, True])
def test_random_workloads_always_add_up(tiny_llama_dir: Path, hicache: bool) -> None:
    """Random prompts sharing random prefixes, a small pool, flushes now and then: for
    every request cached + reasons == prompt tokens, and a prompt whose every page was
    sent before is never reported as never seen."""
    rng = random.Random(13 + hicache)
    extra: dict[str, object] = {"enable_hierarchical_cache": True, "hicache_ratio": 1.5}
    engine = checked_engine(
        tiny_llama_dir, kv_cache_tokens=160, page_size=4, **(extra if hicache else {})
    )
    stems = [prompt(rng.randrange(8, 40), seed=100 + i) for i in range(4)]
    sent: list[list[int]] = []
    for step in range(24):
        tokens = rng.choice(stems)[: rng.randrange(4, 40)] + prompt(rng.randrange(1, 20), step)
        if sent and rng.random() < 0.25:
            tokens = list(rng.choice(sent))  # an exact repeat
        if rng.random() < 0.1:
            engine.flush_cache()
        out = run(engine, tokens)
        got = out.cache_miss_reasons
        assert out.cached_tokens + got.total == len(tokens)
        assert got.below_page == len(tokens) - (len(tokens) - 1) // 4 * 4
        if tokens in sent:
            assert got.never_seen == 0, (step, got)
        sent.append(tokens)
    engine.close()


def test_another_tenants_eviction_is_never_seen_for_this_one(tiny_llama_dir: Path) -> None:
    """Miss reasons follow the cache_salt partition: a prompt tenant A sent and lost is
    `evicted` for A, but `never_seen` for B (else B would learn that someone sent it)."""
    engine = checked_engine(tiny_llama_dir, kv_cache_tokens=256)
    first = prompt(40, seed=21)

    def salted(salt: str) -> RequestOutput:
        return engine.generate([first], dataclasses.replace(PARAMS, cache_salt=salt))[0]

    salted("tenant-a")
    assert engine.flush_cache()
    assert reasons(salted("tenant-b")) == {"never_seen": 39, "below_page": 1}
    assert reasons(run(engine, first)) == {"never_seen": 39, "below_page": 1}  # unsalted
    assert reasons(salted("tenant-a")) == {"evicted": 39, "below_page": 1}
    engine.close()


def test_another_salts_eviction_is_never_seen(tiny_llama_dir: Path) -> None:
    """Tenant A's flushed prompt: evicted for A, never seen for B (an ``evicted`` would
    tell B that someone sent it)."""
    engine = checked_engine(tiny_llama_dir, kv_cache_tokens=256)
    tokens = prompt(40, seed=14)
    salted = {name: replace(PARAMS, cache_salt=name) for name in ("tenant-a", "tenant-b")}
    engine.generate([tokens], salted["tenant-a"])
    assert engine.flush_cache()
    b = engine.generate([tokens], salted["tenant-b"])[0]
    assert reasons(b) == {"never_seen": 39, "below_page": 1}
    unsalted = run(engine, tokens)
    assert reasons(unsalted) == {"never_seen": 39, "below_page": 1}
    assert engine.flush_cache()
    a = engine.generate([tokens], salted["tenant-a"])[0]
    assert reasons(a) == {"evicted": 39, "below_page": 1}
    engine.close()
