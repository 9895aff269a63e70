"""HiCache tree over both tiers: accounting, lock balance and shape under random operations."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.kvcache.allocator import OutOfSlotsError, PageAllocator
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.hicache import HiRadixCache
from engine.kvcache.host_pool import HostKVPool
from engine.kvcache.manager import KVCacheManager
from engine.kvcache.req_table import ReqTable
from engine.platform import DeviceSpec
from engine.request import Req, SamplingParams

CPU = DeviceSpec("cpu", None)


def make(
    num_pages: int, page_size: int, host_tokens: int, policy: str, layout: str, threshold: int = 1
) -> KVCacheManager:
    allocator = PageAllocator(num_pages, page_size)
    pool = DeviceKVPool(2, allocator.num_slots, 1, 4, torch.float32, "cpu")
    host = HostKVPool(2, host_tokens, 1, 4, torch.float32, CPU, layout=layout, page_size=page_size)
    tree = HiRadixCache(allocator, pool, host, policy, load_threshold=threshold)
    return KVCacheManager(allocator, ReqTable(8, 256, torch.device("cpu")), tree)


def fill_kv(manager: KVCacheManager, req: Req, start: int, slots: torch.Tensor) -> None:
    """Write a value derived from (token id, position) so a load-back can be verified."""
    pool = manager.tree.device_pool  # type: ignore[attr-defined]
    ids = req.all_ids
    for i, slot in enumerate(slots.tolist()):
        value = float(ids[start + i] * 1000 + start + i)
        for layer in range(pool.num_layers):
            pool.k_buffers[layer][slot] = value
            pool.v_buffers[layer][slot] = -value


def check_kv_contents(manager: KVCacheManager, req: Req) -> None:
    pool = manager.tree.device_pool  # type: ignore[attr-defined]
    slots = manager.req_table.read(req.row, 0, req.prefix_len)
    ids = req.all_ids
    for i, slot in enumerate(slots.tolist()):
        expect = float(ids[i] * 1000 + i)
        assert pool.k_buffers[1][slot, 0, 0].item() == expect
        assert pool.v_buffers[0][slot, 0, 3].item() == -expect


def check_shape(tree: HiRadixCache) -> None:
    tree.check_host_invariants()
    tree.check_device_children()
    for node in tree.nodes():
        if node.value is not None:
            assert node.parent is tree.root or node.parent.value is not None
        else:
            assert node.host_value is not None, "a node must live on at least one tier"
            assert node.lock_ref == 0


def admit_and_compute(manager: KVCacheManager, req: Req) -> bool:
    manager.admit(req)
    check_kv_contents(manager, req)
    start = req.kv_len
    try:
        slots = manager.alloc(req, req.seq_len - req.kv_len)
    except OutOfSlotsError:
        manager.release(req)
        return False
    fill_kv(manager, req, start, slots)
    return True


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_evicted_conversation_returns_from_host(policy):
    manager = make(12, 1, 64, policy, "layer_first")
    tree = manager.tree
    convo = list(range(100, 110))
    # write_through_selective backs a node up once it has been hit twice (after insertion).
    for _ in range(3 if policy == "write_through_selective" else 1):
        req = Req("a", convo + [1], SamplingParams())
        assert admit_and_compute(manager, req)
        manager.release(req)
    # Push it off the device with other traffic.
    other = Req("b", list(range(200, 211)), SamplingParams())
    assert admit_and_compute(manager, other)
    manager.release(other)
    back = Req("c", convo + [2], SamplingParams())
    manager.admit(back)
    assert back.cached_host > 0 and back.cached_device + back.cached_host == len(convo)
    check_kv_contents(manager, back)
    manager.check_invariants([back])
    check_shape(tree)  # type: ignore[arg-type]


def test_below_threshold_is_recomputed():
    manager = make(12, 1, 64, "write_through", "layer_first", threshold=100)
    tree: HiRadixCache = manager.tree  # type: ignore[assignment]
    req = Req("a", list(range(100, 110)) + [1], SamplingParams())
    assert admit_and_compute(manager, req)
    manager.release(req)
    assert tree.evict(100) == 11
    # The conversation is on the host and nowhere else: a load-back was possible.
    assert tree.cached_tokens == 0 and tree.host_cached_tokens == 11
    assert tree.counters["backup_tokens_total"] == 11
    match = tree.match_prefix(list(range(100, 110)), touch=False)
    assert (match.device_len, match.host_len) == (0, 10)
    again = Req("b", list(range(100, 110)) + [2], SamplingParams())
    # The prefix IS on the host tier: only the threshold makes it recompute.
    assert manager.tree.host_cached_tokens == 11  # type: ignore[attr-defined]
    assert manager.match(again).host_len == 10
    manager.admit(again)
    # 10 host tokens < threshold 100: recomputed, nothing copied back.
    assert again.cached_host == 0 and again.cached_device == 0 and again.prefix_len == 0
    assert tree.counters["loadback_tokens_total"] == 0
    assert tree.cached_tokens == 0 and tree.host_cached_tokens == 11  # backups untouched
    manager.alloc(again, again.seq_len)
    manager.release(again)  # the recomputed KV revives the host-only nodes
    # The 10 shared tokens are on both tiers again (their backup reused, not copied a
    # second time); the new last token is inserted and backed up.
    assert tree.cached_tokens == 11 and tree.host_cached_tokens == 12
    assert tree.counters["backup_tokens_total"] == 12
    revived = tree.match_prefix(list(range(100, 110)), touch=False)
    assert (revived.device_len, revived.host_len) == (10, 0)
    check_shape(tree)
    manager.check_invariants([])


@settings(max_examples=60, deadline=None)
# Regression: a write-back backup made room on the host by evicting the very host-only
# nodes a load-back was about to copy.
@example(seed=348172542, page_size=1, policy="write_back", layout="layer_first")
@given(
    seed=st.integers(0, 2**31),
    page_size=st.sampled_from([1, 2]),
    policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
    layout=st.sampled_from(["layer_first", "page_first"]),
)
def test_random_operations_keep_both_tiers_consistent(seed, page_size, policy, layout):
    rng = random.Random(seed)
    manager = make(48 // page_size, page_size, 40, policy, layout)
    tree: HiRadixCache = manager.tree  # type: ignore[assignment]
    running: list[Req] = []
    stems = [[rng.randrange(4) for _ in range(rng.randrange(2, 14))] for _ in range(4)]
    for step in range(50):
        op = rng.random()
        if op < 0.45 and manager.req_table.free_rows:
            prompt = rng.choice(stems) + [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
            req = Req(f"r{step}", prompt, SamplingParams())
            if admit_and_compute(manager, req):
                running.append(req)
        elif op < 0.85 and running:
            manager.release(running.pop(rng.randrange(len(running))))
        elif op < 0.95:
            tree.evict(rng.randrange(1, 12))
        else:
            tree.evict_host(rng.randrange(1, 12))
        manager.check_invariants(running)
        check_shape(tree)
    for req in running:
        manager.release(req)
    assert tree.protected_tokens == 0
    assert tree.clear()
    assert manager.allocator.free_tokens == manager.capacity
    assert tree.host_pool.available == tree.host_pool.capacity
