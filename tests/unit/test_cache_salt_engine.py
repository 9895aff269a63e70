"""cache_salt through the engine: device, host tier and file L3 store, across a restart.

Each "restart" is a fresh Engine over the same store directory. The references are
independent of the caches: an engine without any cache for the outputs, and, for the
fuzzed test, a plain record of the token prefixes each salt has sent.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from engine import Engine, SamplingParams
from engine.cache_salt import SALT_BUCKETS, salt_bucket, salt_digest
from engine.engine_stats import salt_counter
from tests.unit.cpu_engine import checked_engine

PAGE = 4
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def make_engine(
    model_dir: Path, store_dir: Path, kv_tokens: int = 128, host_ratio: float = 8
) -> Engine:
    return checked_engine(
        model_dir,
        kv_cache_tokens=kv_tokens,
        page_size=PAGE,
        hicache_load_threshold=PAGE,
        enable_hierarchical_cache=True,
        hicache_ratio=host_ratio,
        hicache_storage_backend="file",
        hicache_storage_dir=str(store_dir),
        hicache_storage_prefetch_threshold=8,
        hicache_storage_prefetch_policy="wait_complete",
    )


def salted(salt: str | None, max_tokens: int = PARAMS.max_tokens) -> SamplingParams:
    return dataclasses.replace(PARAMS, cache_salt=salt, max_tokens=max_tokens)


def run(engine: Engine, prompt: list[int], salt: str | None):
    return engine.generate([prompt], salted(salt))[0]


def tiers(out) -> tuple[int, int, int]:
    return out.cached_tokens_device, out.cached_tokens_host, out.cached_tokens_storage


def device_resident(engine: Engine, prompt: list[int], salt: str) -> int:
    match = engine.kv.manager.tree.match_prefix(prompt, touch=False, salt=salt_digest(salt))
    return match.device_len


def test_other_salts_miss_on_every_tier_and_after_a_restart(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(100, 40000) for _ in range(41)]
    full = 40  # whole pages of all but the last prompt token
    plain = checked_engine(tiny_llama_dir, enable_prefix_cache=False)
    expected = plain.generate([prompt], PARAMS)[0].token_ids
    plain.close()

    first = make_engine(tiny_llama_dir, tmp_path)
    assert tiers(run(first, prompt, "alice")) == (0, 0, 0)
    assert tiers(run(first, prompt, "alice")) == (full, 0, 0)  # same salt: hits as before
    assert tiers(run(first, prompt, "bob")) == (0, 0, 0)  # device: alice's copy only
    assert tiers(run(first, prompt, None)) == (0, 0, 0)  # unsalted: its own cache
    assert tiers(run(first, prompt, None)) == (full, 0, 0)
    # Push every copy of the prompt off the device; the host tier keeps them.
    for _ in range(3):
        run(first, [rng.randrange(100, 40000) for _ in range(41)], "filler")
    assert device_resident(first, prompt, "alice") == 0
    out = run(first, prompt, "carol")  # host has alice's, bob's and the unsalted copy
    assert tiers(out) == (0, 0, 0) and out.token_ids == expected
    for _ in range(3):
        run(first, [rng.randrange(100, 40000) for _ in range(41)], "filler")
    assert device_resident(first, prompt, "alice") == 0
    out = run(first, prompt, "alice")
    assert tiers(out) == (0, full, 0) and out.token_ids == expected
    # Salted requests by salt bucket: 11 of 41 prompt tokens; alice's two hits cached.
    stats = first.stats()
    prompt_by_bucket = [stats[salt_counter(b, "prompt")] for b in range(SALT_BUCKETS)]
    cached_by_bucket = [stats[salt_counter(b, "cached")] for b in range(SALT_BUCKETS)]
    assert sum(prompt_by_bucket) == 11 * 41
    assert sum(cached_by_bucket) == cached_by_bucket[salt_bucket(salt_digest("alice"))] == 2 * full
    first.close()  # drains the writer: every page is in the store

    again = make_engine(tiny_llama_dir, tmp_path)
    out = run(again, prompt, "dave")  # the store holds four salts' copies, none of dave's
    assert tiers(out) == (0, 0, 0) and out.token_ids == expected
    out = run(again, prompt, "bob")
    assert tiers(out) == (0, 0, full) and out.token_ids == expected
    out = run(again, prompt, None)  # unsalted pages keep their keys: still found
    assert tiers(out) == (0, 0, full) and out.token_ids == expected
    again.close()


class SeenModel:
    """What each salt has sent: every page-aligned prefix of its prompts and outputs."""

    def __init__(self) -> None:
        self.prefixes: dict[str | None, set[tuple[int, ...]]] = {}

    def add(self, salt: str | None, tokens: list[int]) -> None:
        seen = self.prefixes.setdefault(salt, set())
        for end in range(PAGE, len(tokens) + 1, PAGE):
            seen.add(tuple(tokens[:end]))

    def longest(self, salt: str | None, prompt: list[int]) -> int:
        seen = self.prefixes.get(salt, set())
        ends = range(PAGE, len(prompt), PAGE)  # the last prompt token is always computed
        return max((e for e in ends if tuple(prompt[:e]) in seen), default=0)

    def longest_elsewhere(self, salt: str | None, prompt: list[int]) -> int:
        return max((self.longest(s, prompt) for s in self.prefixes if s != salt), default=0)


@pytest.mark.slow
def test_fuzzed_isolation_over_ten_salts_across_a_restart(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """1,000 requests over 10 salts (and no salt) built from shared system prompts and
    documents: no request is ever served more than its own salt has sent; the same salt
    does hit, on every tier."""
    rng = random.Random(29)
    salts: list[str | None] = [f"tenant-{i}" for i in range(10)] + [None]
    systems = [[rng.randrange(100, 40000) for _ in range(rng.choice((8, 16)))] for _ in range(3)]
    documents = [[rng.randrange(100, 40000) for _ in range(8)] for _ in range(8)]
    model = SeenModel()
    exposed = 0  # prompts another salt had sent a longer prefix of than their own salt
    totals = {"device": 0, "host": 0, "storage": 0}

    def batch(engine: Engine) -> None:
        nonlocal exposed
        picks = []
        for _ in range(10):
            prompt = rng.choice(systems) + rng.choice(documents)
            prompt = prompt + [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 5))]
            picks.append((rng.choice(salts), prompt))
        outs = engine.generate([p for _, p in picks], [salted(s, max_tokens=1) for s, _ in picks])
        for i, ((salt, prompt), out) in enumerate(zip(picks, outs)):
            # A request may also hit the prompt of a same-salt request of its own batch.
            batch_seen = SeenModel()
            for j, (other_salt, other) in enumerate(picks):
                if j != i:
                    batch_seen.add(other_salt, other)
            own = max(model.longest(salt, prompt), batch_seen.longest(salt, prompt))
            assert out.cached_tokens <= own, (salt, out.cached_tokens, own)
            if model.longest_elsewhere(salt, prompt) > own:
                exposed += 1
            totals["device"] += out.cached_tokens_device
            totals["host"] += out.cached_tokens_host
            totals["storage"] += out.cached_tokens_storage
        for (salt, prompt), out in zip(picks, outs):
            model.add(salt, prompt + out.token_ids)

    first = make_engine(tiny_llama_dir, tmp_path, kv_tokens=256, host_ratio=2)
    for _ in range(50):
        batch(first)
    first.close()
    before = dict(totals)
    again = make_engine(tiny_llama_dir, tmp_path, kv_tokens=256, host_ratio=2)
    for _ in range(50):
        batch(again)
    again.close()
    # The test has teeth: many prompts met a longer prefix another salt had cached...
    assert exposed > 150, exposed
    # ...and the partition still lets each salt reuse its own KV on every tier.
    assert before["device"] > 0 and before["host"] > 0
    assert totals["storage"] > before["storage"]
