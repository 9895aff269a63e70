"""Radix tree over token ids whose nodes hold the KV slots of those tokens."""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterator

import torch

from engine.kvcache.allocator import PageAllocator
from engine.kvcache.evicted_pages import EvictedPages
from engine.kvcache.tree_base import PrefixTree
from engine.kvcache.tree_node import MatchResult, TreeNode

_EMPTY = torch.empty(0, dtype=torch.int64)


class RadixCache(PrefixTree):
    """Prefix cache with lock counts and LRU eviction of unlocked leaves.

    NOTE: every device slot is exactly one of free (allocator), owned by a running
    request, or held by a node here: ``free + owned + cached_tokens == capacity``.
    A node with ``lock_ref > 0`` is in use by a running request and is never evicted;
    locking a node locks its whole path to the root.
    """

    def __init__(self, allocator: PageAllocator, enabled: bool = True) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.enabled = enabled
        self.evicted_device_tokens = 0
        self.evicted_pages = EvictedPages()
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        self.root = TreeNode([], _EMPTY, None)
        self.root.lock_ref = 1  # the root is never evicted
        self.cached_tokens = 0  # device tokens held by nodes
        self.protected_tokens = 0  # device tokens held by locked nodes

    def _child_key(
        self, parent: TreeNode, key: list[int], start: int, salt: str
    ) -> tuple[int | str, ...]:
        """The entry in ``parent.children`` of the child whose key starts with
        ``key[start:]``: its first page.

        NOTE: below the root a salted child's entry also names the salt, so each salt
        has its own subtrees and a lookup under one salt never reaches another's (or
        the unsalted) nodes; unsalted entries are the bare page, as they always were.
        """
        page = tuple(key[start : start + self.page_size])
        if salt and parent is self.root:
            return (salt, *page)
        return page

    def _node_key(self, node: TreeNode) -> tuple[int | str, ...]:
        """``node``'s entry in its parent's children."""
        assert node.parent is not None
        return self._child_key(node.parent, node.key, 0, node.salt)

    def _common_len(self, a: list[int], b: list[int], b_start: int) -> int:
        n = min(len(a), len(b) - b_start)
        if a[:n] == b[b_start : b_start + n]:  # the usual case, compared at C speed
            return n - n % self.page_size
        i = 0
        while i < n and a[i] == b[b_start + i]:
            i += 1
        return i - i % self.page_size

    # ------------------------------------------------------------------ match
    def match_prefix(self, key: list[int], touch: bool = True, salt: str = "") -> MatchResult:
        """Longest page-aligned cached prefix of ``key`` among the nodes of ``salt`` (a
        cache_salt digest; "" for unsalted); splits a node matched partway."""
        if not self.enabled:
            return MatchResult(_EMPTY, self.root, 0, self.root)
        node = self.root
        device_parts: list[torch.Tensor] = []
        device_node = self.root
        host_len = 0
        pos = 0
        while len(key) - pos >= self.page_size:
            child = node.children.get(self._child_key(node, key, pos, salt))
            if child is None:
                break
            matched = self._common_len(child.key, key, pos)
            if matched == 0:
                break
            if matched < len(child.key):
                child = self._split(child, matched)
            if child.on_device:
                assert child.value is not None
                device_parts.append(child.value)
                device_node = child
            else:
                host_len += matched
            node = child
            pos += matched
        device_slots = torch.cat(device_parts) if device_parts else _EMPTY
        match = MatchResult(device_slots, device_node, host_len, node)
        if touch:
            self.touch(match)
        return match

    def touch(self, match: MatchResult) -> None:
        """Record a use of every node of ``match`` (LRU time and hit count): what
        ``match_prefix(touch=True)`` does, for a match taken earlier with touch=False."""
        now = time.monotonic()
        node = match.host_node
        while node is not self.root:
            node.last_access = now
            node.hit_count += 1
            assert node.parent is not None
            node = node.parent

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut ``child`` after ``at`` tokens; return the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = TreeNode(child.key[:at], None, parent, child.salt)
        upper.value = child.value[:at] if child.value is not None else None
        upper.host_value = child.host_value[:at] if child.host_value is not None else None
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.hit_count = child.hit_count
        upper.in_storage = child.in_storage  # same pages, same keys: the upper part too
        child.key = child.key[at:]
        child.value = child.value[at:] if child.value is not None else None
        child.host_value = child.host_value[at:] if child.host_value is not None else None
        child.parent = upper
        # upper takes child's place in parent.children with the same device state
        upper.device_children = 1 if child.value is not None else 0
        upper.children[self._node_key(child)] = child
        parent.children[self._node_key(upper)] = upper
        return upper

    # ------------------------------------------------------------------ insert
    def insert(self, key: list[int], slots: torch.Tensor, salt: str = "") -> int:
        """Insert page-aligned ``key`` with device ``slots`` under ``salt`` (as in
        match_prefix); return how many leading tokens were already cached on the device
        (the caller frees its copies of those).
        """
        assert len(key) == slots.numel() and len(key) % self.page_size == 0
        if not self.enabled:
            return 0
        now = time.monotonic()
        node = self.root
        pos = 0
        already = 0
        while pos < len(key):
            child = node.children.get(self._child_key(node, key, pos, salt))
            if child is None:
                new = TreeNode(key[pos:], slots[pos:].clone(), node, salt)
                new.last_access = now
                node.children[self._node_key(new)] = new
                node.device_children += 1
                self.cached_tokens += len(new.key)
                self._on_insert_node(new)
                return already
            matched = self._common_len(child.key, key, pos)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access = now
            if child.on_device:
                already = pos + matched
            else:
                # Host-only node: the request recomputed it; adopt the request's slots.
                child.value = slots[pos : pos + matched].clone()
                node.device_children += 1
                self.cached_tokens += matched
                if child.lock_ref > 0:
                    self.protected_tokens += matched
                self._on_revive_node(child)
            node = child
            pos += matched
        return already

    def _on_insert_node(self, node: TreeNode) -> None:
        """Hook for the host tier (write-through backup)."""

    def _on_revive_node(self, node: TreeNode) -> None:
        """Hook: a host-only node got device slots again."""

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.parent is not None
            if node.lock_ref == 0 and node.value is not None:
                self.protected_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.parent is not None and node.lock_ref > 0
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.value is not None:
                self.protected_tokens -= len(node.key)
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _is_device_leaf(self, node: TreeNode) -> bool:
        return node.value is not None and node.device_children == 0

    def check_device_children(self) -> None:
        """Raise AssertionError if a node's ``device_children`` is not a recount (tests)."""
        for node in [self.root, *self.nodes()]:
            count = sum(1 for c in node.children.values() if c.value is not None)
            assert node.device_children == count, (node.id, node.device_children, count)

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens from unlocked leaves, LRU first."""
        if num_tokens <= 0:
            return 0
        heap = [n for n in self.nodes() if n.lock_ref == 0 and self._is_device_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)
            parent = node.parent  # read first: deleting the node unlinks it
            freed += self._evict_node(node)
            if (
                parent is not None
                and parent is not self.root
                and parent.lock_ref == 0
                and self._is_device_leaf(parent)
            ):
                heapq.heappush(heap, parent)
        self.evicted_device_tokens += freed
        return freed

    def _evict_node(self, node: TreeNode) -> int:
        """Drop ``node``'s device KV; delete the node (HiCache keeps it host-only)."""
        assert node.value is not None and node.lock_ref == 0
        n = len(node.key)
        self._before_device_evict(node)
        self.allocator.free(node.value)
        node.value = None
        assert node.parent is not None
        node.parent.device_children -= 1
        self.cached_tokens -= n
        if not self._keep_on_host(node):
            self._delete(node)
        return n

    def _before_device_evict(self, node: TreeNode) -> None:
        """Hook for the host tier (write-back backup while the device copy still exists)."""

    def _keep_on_host(self, node: TreeNode) -> bool:
        """Hook for the host tier: True keeps ``node`` as a host-only node."""
        return False

    def _delete(self, node: TreeNode) -> None:
        assert not node.children and node.parent is not None
        assert node.value is None, "device slots are dropped first (parent's device_children)"
        self.evicted_pages.record(node, self.page_size)
        del node.parent.children[self._node_key(node)]
        node.parent = None

    def clear(self) -> bool:
        """Drop every unlocked cached prefix; False if locked nodes remain."""
        self.evict(self.cached_tokens)
        return self.protected_tokens == 0 and self.cached_tokens == 0
