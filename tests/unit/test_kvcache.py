"""Allocator, request table and radix cache: nothing leaks, nothing overlaps."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kvcache.allocator import OutOfSlotsError, PageAllocator
from engine.kvcache.manager import KVCacheManager
from engine.kvcache.radix_cache import RadixCache
from engine.kvcache.req_table import ReqTable
from engine.request import Req, SamplingParams


def make_manager(num_pages: int, page_size: int, enabled: bool = True) -> KVCacheManager:
    allocator = PageAllocator(num_pages, page_size)
    table = ReqTable(8, 512, torch.device("cpu"))
    return KVCacheManager(allocator, table, RadixCache(allocator, enabled=enabled))


def tree_pages(tree: RadixCache) -> list[int]:
    pages: list[int] = []
    for node in tree.nodes():
        if node.value is not None:
            pages.extend(torch.unique(node.value // tree.page_size).tolist())
    return pages


def owned_pages(manager: KVCacheManager, req: Req) -> list[int]:
    slots = manager.req_table.read(req.row, req.prefix_len, req.kv_len)
    return torch.unique(slots // manager.page_size).tolist()


def check_exact_partition(manager: KVCacheManager, running: list[Req]) -> None:
    """Every page is exactly one of: free, owned by one running request, held by the tree."""
    manager.check_invariants(running)
    free = manager.allocator.free_page_ids()
    owned = [p for r in running for p in owned_pages(manager, r)]
    cached = tree_pages(manager.tree)
    everything = free + owned + cached
    assert len(everything) == len(set(everything)), "a page has two owners"
    assert sorted(everything) == list(range(1, manager.allocator.num_pages + 1))


def check_tree_shape(tree: RadixCache) -> None:
    protected = 0
    for node in tree.nodes():
        assert len(node.key) % tree.page_size == 0 and node.key
        if node.value is not None:
            assert node.value.numel() == len(node.key)
            assert node.parent is tree.root or node.parent.value is not None
            if node.lock_ref > 0:
                protected += len(node.key)
        assert node.lock_ref >= 0
        for child in node.children.values():
            assert child.lock_ref <= node.lock_ref
    assert protected == tree.protected_tokens
    tree.check_device_children()


def test_allocator_pages_and_reserved_page():
    alloc = PageAllocator(4, 2)
    slots = alloc.alloc_pages(3)
    assert slots.tolist() == [2, 3, 4, 5, 6, 7]  # page 0 (slots 0, 1) is the dummy
    assert alloc.free_tokens == 2
    with pytest.raises(OutOfSlotsError):
        alloc.alloc_pages(2)
    alloc.free(slots[:2])
    assert alloc.free_tokens == 4


def test_prefix_reuse_and_release():
    manager = make_manager(64, 1)
    a = Req("a", list(range(10, 30)), SamplingParams())
    manager.admit(a)
    assert a.prefix_len == 0
    manager.alloc(a, a.seq_len)
    a.output_ids.append(99)
    manager.release(a)
    assert manager.tree.cached_tokens == 20
    b = Req("b", list(range(10, 25)) + [7, 8], SamplingParams())
    manager.admit(b)
    assert b.prefix_len == 15 and b.cached_device == 15
    check_exact_partition(manager, [b])
    manager.alloc(b, b.seq_len - b.kv_len)
    check_exact_partition(manager, [b])
    manager.release(b)
    check_exact_partition(manager, [])
    assert manager.tree.protected_tokens == 0


@pytest.mark.parametrize("reuse_match", [False, True], ids=["rematch", "reuse"])
def test_admit_with_an_earlier_match_is_the_same_admission(reuse_match: bool) -> None:
    """The scheduler hands admit() the match it sized the admission with; that must lock,
    hit and touch exactly what a fresh match inside admit() would."""
    manager = make_manager(64, 1)
    a = Req("a", list(range(10, 30)), SamplingParams())
    manager.admit(a)
    manager.alloc(a, a.seq_len)
    a.output_ids.append(99)
    manager.release(a)
    b = Req("b", [*range(10, 22), 5, 6], SamplingParams())  # splits a's node after 12
    match = manager.match(b)
    assert match.device_len == 12
    hits_before = {id(n): n.hit_count for n in manager.tree.nodes()}
    manager.admit(b, match if reuse_match else None)
    assert b.prefix_len == b.kv_len == 12 and b.cached_device == 12
    assert b.last_node is match.device_node and b.last_node.lock_ref == 1
    path = []
    node = b.last_node
    while node is not manager.tree.root:
        path.append(node)
        node = node.parent
    assert all(n.hit_count == hits_before[id(n)] + 1 for n in path)  # touched once
    check_exact_partition(manager, [b])
    check_tree_shape(manager.tree)
    manager.alloc(b, b.seq_len - b.kv_len)
    manager.release(b)
    check_exact_partition(manager, [])


def test_full_prompt_hit_still_computes_last_token():
    manager = make_manager(64, 1)
    a = Req("a", [1, 2, 3, 4], SamplingParams())
    manager.admit(a)
    manager.alloc(a, 4)
    manager.release(a)
    b = Req("b", [1, 2, 3, 4], SamplingParams())
    manager.admit(b)
    assert b.prefix_len == 3  # the last token is recomputed to get its logits


def test_eviction_frees_lru_unlocked_leaves_only():
    manager = make_manager(16, 1)
    old = Req("old", [1, 2, 3, 4, 5], SamplingParams())
    manager.admit(old)
    manager.alloc(old, 5)
    manager.release(old)
    keep = Req("keep", [9, 9, 9, 9, 9, 6], SamplingParams())
    manager.admit(keep)
    manager.alloc(keep, 6)
    manager.release(keep)
    user = Req("user", [9, 9, 9, 9, 9, 7], SamplingParams())
    manager.admit(user)  # locks [9]*5
    freed = manager.tree.evict(100)
    assert freed == 6  # the unlocked "old" branch and the [6] leaf; never the locked [9]*5
    assert manager.tree.match_prefix([9, 9, 9, 9, 9, 1]).device_len == 5
    assert manager.tree.match_prefix([1, 2, 3]).device_len == 0
    check_exact_partition(manager, [user])


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    page_size=st.sampled_from([1, 2, 4]),
    enabled=st.booleans(),
)
def test_random_operations_keep_accounting(seed: int, page_size: int, enabled: bool):
    rng = random.Random(seed)
    manager = make_manager(40 // page_size + 2, page_size, enabled)
    running: list[Req] = []
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    for step in range(60):
        op = rng.random()
        if op < 0.35 and manager.req_table.free_rows:
            prompt = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(1, 8))]
            req = Req(f"r{step}", prompt, SamplingParams())
            manager.admit(req)
            try:
                manager.alloc(req, req.seq_len - req.kv_len)
                running.append(req)
            except OutOfSlotsError:
                manager.release(req)
        elif op < 0.65 and running:
            req = rng.choice(running)
            try:
                manager.alloc(req, rng.randrange(1, 4))
                req.output_ids.extend(rng.randrange(5) for _ in range(1))
                # keep seq_len == kv_len + 1 shape loosely: tokens beyond kv are free-form
                while req.seq_len < req.kv_len:
                    req.output_ids.append(rng.randrange(5))
            except OutOfSlotsError:
                pass
        elif op < 0.9 and running:
            req = running.pop(rng.randrange(len(running)))
            while req.seq_len < req.kv_len:
                req.output_ids.append(rng.randrange(5))
            manager.release(req)
        else:
            manager.tree.evict(rng.randrange(1, 10))
        check_exact_partition(manager, running)
        check_tree_shape(manager.tree)
    for req in running:
        while req.seq_len < req.kv_len:
            req.output_ids.append(0)
        manager.release(req)
    check_exact_partition(manager, [])
    assert manager.tree.protected_tokens == 0
    assert manager.tree.clear()
    assert manager.allocator.free_tokens == manager.capacity
