"""The eviction record and the split of a prompt's misses into reasons, without a model.

The tree tests insert and evict through a real ``RadixCache`` and compare the record
against the pages the test itself knows it dropped.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kvcache.allocator import PageAllocator
from engine.kvcache.evicted_pages import ROOT_DIGEST, EvictedPages, end_digest, page_digests
from engine.kvcache.miss_reasons import MISS_REASONS, MissReasons, attribute
from engine.kvcache.radix_cache import RadixCache


def tree_with(page_size: int, *keys: list[int]) -> RadixCache:
    tree = RadixCache(PageAllocator(512, page_size))
    for key in keys:
        slots = tree.allocator.alloc_pages(len(key) // page_size)
        already = tree.insert(key, slots)
        if already:
            tree.allocator.free(slots[:already])
    return tree


def test_digests_name_the_whole_prefix() -> None:
    a = list(page_digests(ROOT_DIGEST, [1, 2, 3, 4], 2))
    b = list(page_digests(ROOT_DIGEST, [9, 9, 3, 4], 2))
    assert len(a) == 2 and a[1] != b[1]  # same last page, other prefix: another digest
    # Chained: continuing from the digest of [1, 2] gives the same digest as from scratch.
    assert list(page_digests(a[0], [3, 4], 2)) == [a[1]]
    assert list(page_digests(ROOT_DIGEST, [1, 2, 3], 2)) == a[:1]  # whole pages only


def test_a_node_digest_survives_a_split() -> None:
    tree = tree_with(2, [1, 2, 3, 4, 5, 6])
    (node,) = tree.root.children.values()
    whole = end_digest(node, 2)
    tree.insert([1, 2, 7, 8], tree.allocator.alloc_pages(2))  # splits the node after 2
    upper = tree.root.children[(1, 2)]
    assert upper.key == [1, 2] and node.parent is upper
    assert end_digest(node, 2) == whole
    assert end_digest(upper, 2) == next(page_digests(ROOT_DIGEST, [1, 2], 2))


def test_the_tree_records_what_it_drops() -> None:
    kept, dropped = [1, 2, 3, 4], [1, 2, 5, 6, 7, 8]
    tree = tree_with(2, kept, dropped)
    leaf = tree.match_prefix(dropped).device_node
    tree.lock(tree.match_prefix(kept).device_node)
    tree.evict(4)  # only the unlocked leaf [5, 6, 7, 8] can go
    assert leaf.parent is None
    record = tree.evicted_pages
    assert len(record) == 2
    # Seen: the dropped run after [1, 2]; a never-cached continuation stops the run.
    prior = next(page_digests(ROOT_DIGEST, [1, 2], 2))
    assert record.seen_len(prior, [5, 6, 7, 8, 9, 9], 2) == 4
    assert record.seen_len(prior, [5, 6, 0, 0], 2) == 2
    assert record.seen_len(prior, [3, 4], 2) == 0  # still cached, never evicted
    assert record.seen_len(prior, [5, 6, 7, 8], 2, skip=2) == 2  # the scan starts later


def test_the_record_is_bounded() -> None:
    record = EvictedPages(max_pages=8)
    for digest in range(100):
        record.add(digest)
        assert len(record) <= 8
        # the newest max_pages // 2 are always kept
        assert all(d in record for d in range(max(0, digest - 3), digest + 1))
    assert 0 not in record and 50 not in record


def test_attribute_counts_each_position_once() -> None:
    # 100 prompt tokens, 96 cacheable, 16 cached; host span 16-32 not loaded, the store
    # late on 24-48, evicted from 48 to 64, the rest never seen.
    got = attribute(100, 96, 16, seen=(48, 64), not_loaded=(16, 32), late=(24, 48))
    assert got == MissReasons(
        never_seen=32, evicted=16, below_page=4, not_loaded=16, storage_timeout=16
    )
    assert got.total == 100 - 16
    assert attribute(10, 8, 8) == MissReasons(below_page=2)  # all cacheable tokens cached
    assert attribute(10, 0, 0) == MissReasons(below_page=10)  # a scored prompt


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_attribute_always_adds_up(data: st.DataObject) -> None:
    prompt_len = data.draw(st.integers(0, 200))
    cacheable = data.draw(st.integers(0, prompt_len))
    cached = data.draw(st.integers(0, cacheable))

    def span() -> tuple[int, int] | None:
        if not data.draw(st.booleans()):
            return None
        lo = data.draw(st.integers(-10, 210))
        return lo, data.draw(st.integers(lo, 220))

    got = attribute(prompt_len, cacheable, cached, span(), span(), span())
    assert cached + got.total == prompt_len
    assert all(getattr(got, name) >= 0 for name in MISS_REASONS)
    assert got.below_page == prompt_len - cacheable and got.not_routed == 0


def test_reasons_add_as_counts() -> None:
    rng = random.Random(0)
    parts = [MissReasons(**{n: rng.randrange(9) for n in MISS_REASONS}) for _ in range(5)]
    total = sum(parts, MissReasons())
    for name in MISS_REASONS:
        assert getattr(total, name) == sum(getattr(p, name) for p in parts)
