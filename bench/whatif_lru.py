"""The engine's trees with their LRU victims kept in a heap between evictions.

``RadixCache.evict`` and ``HiRadixCache.evict_host`` collect their candidate leaves by
walking the whole tree on every call: right for a server, where a call frees many pages
at once, but quadratic for a replay that evicts on almost every request of a 100k-request
trace. These subclasses keep the candidates in a heap instead, pushed where a node can
become one (inserted, revived, unlocked, its last child evicted, kept host-only) and
checked when popped (still a leaf, unlocked, same ``last_access``, else pushed again with
the new one), then evict through the real ``_evict_node`` / ``_free_host`` / ``_delete``.
The victims are the trees' own, in the same order: tests/unit/test_whatif.py replays
traces through both and compares every request's hits.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from engine.kvcache.evicted_pages import EvictedPages
from engine.kvcache.hicache import HiRadixCache
from engine.kvcache.radix_cache import RadixCache
from engine.kvcache.tree_node import TreeNode

_Heap = list[tuple[float, int, TreeNode]]


class _NoEvictionRecord(EvictedPages):
    """The replay reports no miss reasons: dropped pages need not be digested (the
    record only ever feeds miss reasons, never a choice of the tree)."""

    def record(self, node: TreeNode, page_size: int) -> None:
        return None


class IndexedRadixCache(RadixCache):
    """RadixCache whose device LRU leaves are kept in a heap (see the module docstring)."""

    def reset(self) -> None:
        super().reset()
        self.evicted_pages = _NoEvictionRecord(1)
        self._device_heap: _Heap = []
        self.rescans = 0  # full walks after the heap ran dry (0 when nothing was missed)
        self.verify = False  # tests: walk the tree when the host heap runs dry

    def _push_device(self, node: TreeNode) -> None:
        heapq.heappush(self._device_heap, (node.last_access, node.id, node))

    def _device_victim(self, node: TreeNode) -> bool:
        return node.parent is not None and node.lock_ref == 0 and self._is_device_leaf(node)

    def _pop(self, heap: _Heap, check: Callable[[TreeNode], bool]) -> TreeNode | None:
        while heap:
            stamp, _, node = heapq.heappop(heap)
            if not check(node):
                continue
            if node.last_access != stamp:  # touched since it was pushed
                heapq.heappush(heap, (node.last_access, node.id, node))
                continue
            return node
        return None

    def _on_insert_node(self, node: TreeNode) -> None:
        super()._on_insert_node(node)
        self._push_device(node)

    def _on_revive_node(self, node: TreeNode) -> None:
        super()._on_revive_node(node)
        self._push_device(node)

    def unlock(self, node: TreeNode) -> None:
        super().unlock(node)
        if node is not self.root and node.lock_ref == 0:
            self._push_device(node)

    def evict(self, num_tokens: int) -> int:
        """RadixCache.evict with the heap kept between calls."""
        if num_tokens <= 0:
            return 0
        freed = 0
        while freed < num_tokens:
            node = self._pop(self._device_heap, self._device_victim)
            if node is None:
                if self.cached_tokens == self.protected_tokens:
                    break
                self.rescans += 1  # a candidate was missed: walk the tree once
                for n in self.nodes():
                    if self._device_victim(n):
                        self._push_device(n)
                node = self._pop(self._device_heap, self._device_victim)
                if node is None:
                    break
            parent = node.parent
            freed += self._evict_node(node)
            if parent is not None and parent is not self.root and self._device_victim(parent):
                self._push_device(parent)
        self.evicted_device_tokens += freed
        return freed


class IndexedHiRadixCache(HiRadixCache, IndexedRadixCache):
    """HiRadixCache with heaps of device and host-only LRU leaves (no L3 attached)."""

    def reset(self) -> None:
        super().reset()
        self._host_heap: _Heap = []

    def _push_host(self, node: TreeNode) -> None:
        heapq.heappush(self._host_heap, (node.last_access, node.id, node))

    def _host_victim(self, node: TreeNode) -> bool:
        return (
            node.parent is not None
            and node.value is None
            and node.host_value is not None
            and not node.children
            and node.lock_ref == 0
        )

    def _on_insert_node(self, node: TreeNode) -> None:
        HiRadixCache._on_insert_node(self, node)
        self._push_device(node)

    def _on_revive_node(self, node: TreeNode) -> None:
        HiRadixCache._on_revive_node(self, node)
        self._push_device(node)

    def unlock(self, node: TreeNode) -> None:
        super().unlock(node)
        if node is not self.root and node.lock_ref == 0:
            self._push_host(node)

    def _evict_node(self, node: TreeNode) -> int:
        freed = super()._evict_node(node)
        if self._host_victim(node):  # kept host-only as a leaf
            self._push_host(node)
        return freed

    def evict_host(self, num_tokens: int) -> int:
        """HiRadixCache.evict_host with the heap kept between calls."""
        assert self.storage is None, "the replay models L3 itself"
        freed = 0
        while freed < num_tokens:
            node = self._pop(self._host_heap, self._host_victim)
            if node is None:
                missed = [n for n in self.nodes() if self._host_victim(n)] if self.verify else []
                if not missed:
                    break
                self.rescans += 1  # tests: a candidate was missed
                for n in missed:
                    self._push_host(n)
                continue
            parent = node.parent
            freed += len(node.key)
            self._free_host(node)
            RadixCache._delete(self, node)
            if parent is not None and parent is not self.root and self._host_victim(parent):
                self._push_host(parent)
        self.counters["evicted_host_tokens_total"] += freed
        return freed
