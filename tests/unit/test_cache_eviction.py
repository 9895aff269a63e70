"""Eviction order on both tiers: device LRU over unlocked leaves, host LRU over host-only
leaves, and parents that become leaves joining the queue in their own LRU place.

The tree's clock is replaced by a counter, so every insert and match has a distinct time
in the order of the calls and the expected order is exact (no reliance on the wall
clock's resolution). ``t=k`` in the comments is that order, not the counter's value.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from engine.kvcache import radix_cache
from engine.kvcache.allocator import PageAllocator
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.hicache import HiRadixCache
from engine.kvcache.host_pool import HostKVPool
from engine.kvcache.radix_cache import RadixCache
from engine.platform import DeviceSpec


@pytest.fixture(autouse=True)
def ticking_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call of the tree's clock returns the next integer."""
    ticks = itertools.count(1)
    monkeypatch.setattr(radix_cache, "time", SimpleNamespace(monotonic=lambda: next(ticks)))


def insert(tree: RadixCache, key: list[int]) -> None:
    """Insert ``key`` as a finished request would: fresh slots for the tokens the tree does
    not hold yet, the duplicates freed again."""
    slots = tree.allocator.alloc_pages(len(key))
    already = tree.insert(key, slots)
    if already:
        tree.allocator.free(slots[:already])


def device_keys(tree: RadixCache) -> list[list[int]]:
    """Full token paths of the device-resident leaves, sorted."""
    return sorted(_path(tree, n) for n in tree.nodes() if tree._is_device_leaf(n))


def host_only_keys(tree: RadixCache) -> list[list[int]]:
    return sorted(_path(tree, n) for n in tree.nodes() if n.value is None)


def _path(tree: RadixCache, node: radix_cache.TreeNode) -> list[int]:
    parts: list[list[int]] = []
    while node is not tree.root:
        parts.append(node.key)
        assert node.parent is not None
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def check_device_accounting(tree: RadixCache) -> None:
    held = sum(len(n.key) for n in tree.nodes() if n.value is not None)
    assert held == tree.cached_tokens
    assert tree.allocator.free_tokens + tree.cached_tokens == tree.allocator.capacity


def test_device_eviction_takes_the_least_recently_used_leaf_first() -> None:
    tree = RadixCache(PageAllocator(32, 1))
    insert(tree, [1, 2, 3])  # t=1
    insert(tree, [4, 5, 6])  # t=2
    insert(tree, [7, 8, 9])  # t=3
    assert tree.match_prefix([1, 2, 3]).device_len == 3  # t=4: [1, 2, 3] is now the newest
    assert tree.evict(1) == 3  # whole leaves: the oldest one, [4, 5, 6]
    assert device_keys(tree) == [[1, 2, 3], [7, 8, 9]]
    assert tree.evict(3) == 3
    assert device_keys(tree) == [[1, 2, 3]]
    assert tree.evicted_device_tokens == 6
    check_device_accounting(tree)


def test_device_eviction_reaches_a_parent_once_its_children_are_gone() -> None:
    tree = RadixCache(PageAllocator(32, 1))
    insert(tree, [1, 2, 3, 4, 5])  # t=1
    insert(tree, [30, 31])  # t=2
    insert(tree, [1, 2, 3, 9])  # t=3: splits into [1, 2, 3] -> {[4, 5], [9]}
    insert(tree, [40, 41])  # t=4
    # Leaves by age: [4, 5] (t=1), [30, 31] (t=2), [9] (t=3), [40, 41] (t=4). The parent
    # [1, 2, 3] (t=3, touched by the second insert) is no leaf while it has children.
    assert tree.evict(4) == 4
    assert device_keys(tree) == [[1, 2, 3, 9], [40, 41]]
    # [9] goes; its parent becomes a leaf and, older than [40, 41], goes in the same call.
    assert tree.evict(4) == 4
    assert device_keys(tree) == [[40, 41]]
    check_device_accounting(tree)


def test_locked_path_survives_any_eviction() -> None:
    tree = RadixCache(PageAllocator(32, 1))
    insert(tree, [1, 2, 3, 4])  # t=1: the oldest, but locked below
    insert(tree, [1, 2, 7])  # t=2: splits into [1, 2] -> {[3, 4], [7]}
    insert(tree, [5, 6])  # t=3
    match = tree.match_prefix([1, 2, 3, 4])
    tree.lock(match.device_node)  # a running request uses [1, 2, 3, 4]
    assert tree.protected_tokens == 4
    assert tree.evict(100) == 3  # [7] and [5, 6]; [1, 2] keeps a locked child
    assert device_keys(tree) == [[1, 2, 3, 4]]
    tree.unlock(match.device_node)
    assert tree.evict(100) == 4 and tree.cached_tokens == 0
    check_device_accounting(tree)


def make_hicache(host_tokens: int = 64) -> HiRadixCache:
    allocator = PageAllocator(32, 1)
    pool = DeviceKVPool(2, allocator.num_slots, 1, 4, torch.float32, "cpu")
    host = HostKVPool(2, host_tokens, 1, 4, torch.float32, DeviceSpec("cpu", None), page_size=1)
    return HiRadixCache(allocator, pool, host, "write_through", load_threshold=1)


def test_device_eviction_keeps_backed_up_leaves_on_the_host_in_lru_order() -> None:
    tree = make_hicache()
    insert(tree, [1, 2, 3])  # t=1, backed up at once (write_through)
    insert(tree, [4, 5, 6])  # t=2
    assert tree.host_cached_tokens == 6
    assert tree.evict(3) == 3
    assert device_keys(tree) == [[4, 5, 6]] and host_only_keys(tree) == [[1, 2, 3]]
    match = tree.match_prefix([1, 2, 3, 0])
    assert (match.device_len, match.host_len) == (0, 3)
    tree.check_host_invariants()
    check_device_accounting(tree)


def test_host_eviction_takes_lru_host_only_leaves_then_their_parents() -> None:
    tree = make_hicache()
    insert(tree, [1, 2, 3, 4, 5])  # t=1
    insert(tree, [1, 2, 3, 9])  # t=2: [1, 2, 3] (t=2) -> {[4, 5] (t=1), [9] (t=2)}
    insert(tree, [7, 8])  # t=3
    assert tree.evict(100) == 8  # everything leaves the device ...
    assert tree.cached_tokens == 0 and tree.host_cached_tokens == 8  # ... kept on the host
    assert host_only_keys(tree) == [[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 8]]

    assert tree.evict_host(1) == 2  # the oldest host-only leaf, whole: [4, 5]
    assert host_only_keys(tree) == [[1, 2, 3], [1, 2, 3, 9], [7, 8]]
    # [9] goes; its parent [1, 2, 3] (t=2) becomes a host-only leaf older than [7, 8]
    # (t=3) and goes next, in the same call.
    assert tree.evict_host(2) == 4
    assert host_only_keys(tree) == [[7, 8]]
    assert tree.counters["evicted_host_tokens_total"] == 6
    assert tree.host_pool.available == tree.host_pool.capacity - 2
    tree.check_host_invariants()


def test_host_eviction_spares_nodes_still_on_the_device() -> None:
    tree = make_hicache()
    insert(tree, [1, 2, 3])  # t=1: backed up, and still on the device
    insert(tree, [4, 5])  # t=2
    assert tree.evict(2) == 3  # [1, 2, 3], the older, becomes host-only
    assert tree.evict_host(100) == 3  # only the host-only node may go
    assert host_only_keys(tree) == [] and device_keys(tree) == [[4, 5]]
    [node] = list(tree.nodes())
    assert node.host_value is not None  # [4, 5] keeps its backup too
    tree.check_host_invariants()
    check_device_accounting(tree)
