"""HiCache through the engine: same greedy tokens as without it, and host hits counted."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import Engine, SamplingParams
from tests.unit.cpu_engine import checked_engine

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def multiturn(engine: Engine, clients: int = 5, rounds: int = 3, seed: int = 0):
    """Conversations that come back after the others pushed them off the device."""
    rng = random.Random(seed)
    convos = [[rng.randrange(100, 40000) for _ in range(40)] for _ in range(clients)]
    outputs, cached, host, prompt_tokens = [], 0, 0, 0
    for r in range(rounds):
        for c in range(clients):
            if r:
                convos[c] = convos[c] + [rng.randrange(100, 40000) for _ in range(8)]
            out = engine.generate([convos[c]], PARAMS)[0]
            outputs.append(out.token_ids)
            cached += out.cached_tokens
            host += out.cached_tokens_host
            prompt_tokens += len(convos[c])
            convos[c] = convos[c] + out.token_ids
    return outputs, cached, host, prompt_tokens


def engine_for(model_dir: Path, **kw) -> Engine:
    # Working set ~5 x 70 tokens, several times this device pool.
    return checked_engine(model_dir, **{"kv_cache_tokens": 128, "hicache_load_threshold": 4, **kw})


@pytest.fixture(scope="module")
def radix_run(tiny_llama_dir):
    return multiturn(engine_for(tiny_llama_dir))


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_same_outputs_and_host_hits(tiny_llama_dir, radix_run, policy, layout):
    radix_outputs, radix_cached, radix_host, prompt_tokens = radix_run
    eng = engine_for(
        tiny_llama_dir,
        enable_hierarchical_cache=True,
        hicache_ratio=8,
        hicache_write_policy=policy,
        hicache_mem_layout=layout,
    )
    outputs, cached, host, _ = multiturn(eng)
    assert outputs == radix_outputs
    assert radix_host == 0
    tree = eng.kv.manager.tree
    tree.check_host_invariants()  # type: ignore[attr-defined]
    stats = eng.stats()
    assert stats["host_cached"] + stats["host_free"] == stats["host_total"]
    if policy == "write_through_selective":
        # Nothing is hit twice before it is evicted in this workload: nothing is backed up,
        # so no host hits, and the device tier behaves exactly as plain radix.
        assert stats["backup_tokens_total"] == 0
        assert host == 0 and cached == radix_cached
        return
    assert host > 0
    assert stats["loadback_tokens_total"] == host
    assert stats["cached_tokens_host_total"] == host
    assert stats["backup_tokens_total"] > 0
    assert cached > 2 * radix_cached, (cached, radix_cached, prompt_tokens)


def test_off_behaves_as_plain_radix(tiny_llama_dir, radix_run):
    eng = engine_for(tiny_llama_dir, enable_hierarchical_cache=False)
    outputs, cached, host, _ = multiturn(eng)
    assert (outputs, cached, host) == radix_run[:3]
    assert eng.health()["hicache"] is False


def test_health_reports_host_tier(tiny_llama_dir):
    eng = engine_for(tiny_llama_dir, enable_hierarchical_cache=True, hicache_ratio=2)
    health = eng.health()
    assert health["hicache"] is True
    assert health["host_alloc_method"] == "pageable" and health["pinned"] is False
    assert health["host_total_tokens"] == 2 * health["kv_total_tokens"]
