"""HiCache: one radix tree over the device pool and the host tier."""

from __future__ import annotations

import heapq
import logging
from typing import Any

import torch

from engine import platform
from engine.kvcache.allocator import PageAllocator
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.host_pool import HostKVPool
from engine.kvcache.radix_cache import RadixCache
from engine.kvcache.storage.prefetch import Prefetch
from engine.kvcache.storage.tier import StorageTier
from engine.kvcache.transfer import KVTransfer
from engine.kvcache.tree_node import MatchResult, TreeNode

logger = logging.getLogger("hiserve.hicache")


class HiRadixCache(RadixCache):
    """Radix cache whose nodes may also (or only) live in host memory.

    NOTE: host slots are held only by tree nodes: ``host_free + host_cached ==
    host capacity``. Device eviction turns a backed-up leaf into a host-only node (else
    deletes it); host eviction removes only host-only leaves. Device-resident nodes form
    a subtree hanging from the root, host-only nodes hang below it. A node whose backup
    is in flight is locked until the copy completes.
    """

    def __init__(
        self,
        allocator: PageAllocator,
        device_pool: DeviceKVPool,
        host_pool: HostKVPool,
        write_policy: str = "write_through",
        load_threshold: int = 16,
        device: platform.DeviceSpec | None = None,
        storage: StorageTier | None = None,
        transfer: KVTransfer | None = None,
    ) -> None:
        self.device_pool = device_pool
        self.host_pool = host_pool
        # The copier between the tiers; tensor parallel passes one that records each copy.
        self.transfer = transfer or KVTransfer(device_pool, host_pool, device)
        self.write_policy = write_policy
        self.load_threshold = load_threshold
        self.storage = storage  # the L3 tier below the host tier, if any
        self.token_bytes = device_pool.bytes_per_token
        self._pending: list[tuple[Any, TreeNode]] = []  # (transfer handle, locked node)
        self._loads_new: list[Any] = []  # loads the next forward must wait for, per layer
        self._loads_inflight: list[Any] = []  # kept referenced until the copy is done
        self.host_cached_tokens = 0
        self.counters = dict.fromkeys(
            (
                "evicted_host_tokens_total",
                "backup_tokens_total",
                "backup_bytes_total",
                "loadback_tokens_total",
                "loadback_bytes_total",
            ),
            0,
        )
        super().__init__(allocator, enabled=True)

    def reset(self) -> None:
        super().reset()
        self.host_cached_tokens = 0

    # ------------------------------------------------------------------ backup
    def _backup(self, node: TreeNode, wait: bool = False) -> bool:
        """Copy ``node``'s device KV to fresh host slots; False if the host tier is full."""
        if node.host_value is not None or node.value is None:
            return node.host_value is not None
        n = len(node.key)
        host_slots = self._alloc_host(n)
        if host_slots is None:
            return False
        host_slots = host_slots[:n]
        handle = self.transfer.backup_async(node.value, host_slots)
        node.host_value = host_slots
        self.host_cached_tokens += n
        self.counters["backup_tokens_total"] += n
        self.counters["backup_bytes_total"] += n * self.token_bytes
        if wait:
            handle.wait()
        elif not handle.done():
            self.lock(node)  # the device copy must outlive the transfer
            self._pending.append((handle, node))
            return True
        if self.storage is not None:
            self.storage.on_host_copy(node)
        return True

    def poll(self) -> None:
        """Unlock nodes whose backup finished; forget finished loads (never blocks).

        NOTE: called before every eviction, every match and every batch (take_load_handles):
        a decode-only phase must still unlock finished backups, or their nodes stay
        unevictable and running requests get retracted for nothing."""
        self._loads_inflight = [h for h in self._loads_inflight if not h.done()]
        still: list[tuple[Any, TreeNode]] = []
        for handle, node in self._pending:
            if handle.done():
                self.unlock(node)
                if self.storage is not None and node.host_value is not None:
                    self.storage.on_host_copy(node)
            else:
                still.append((handle, node))
        self._pending = still
        if self.storage is not None:
            self.storage.poll()

    def wait_backups(self) -> None:
        """Block until every backup in flight is finished, then unlock their nodes."""
        for handle, _ in self._pending:
            handle.wait()
        self.poll()

    @property
    def backups_in_flight(self) -> bool:
        return bool(self._pending)

    @property
    def evictable_tokens(self) -> int:
        self.poll()
        return self.cached_tokens - self.protected_tokens

    def _on_insert_node(self, node: TreeNode) -> None:
        if self.write_policy == "write_through":
            self._backup(node)

    def _on_revive_node(self, node: TreeNode) -> None:
        self._on_insert_node(node)

    def match_prefix(self, key: list[int], touch: bool = True, salt: str = "") -> MatchResult:
        self.poll()
        return super().match_prefix(key, touch, salt)

    def touch(self, match: MatchResult) -> None:
        super().touch(match)
        if self.write_policy == "write_through_selective":  # back up what is hit twice
            node = match.device_node
            while node is not self.root:
                if node.hit_count >= 2 and node.host_value is None:
                    self._backup(node)
                assert node.parent is not None
                node = node.parent

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Device LRU eviction; waits for backups in flight before it gives up short (their
        nodes are locked until the copy lands)."""
        self.poll()
        freed = super().evict(num_tokens)
        if freed < num_tokens and self._pending:
            self.wait_backups()
            freed += super().evict(num_tokens - freed)
        return freed

    def _before_device_evict(self, node: TreeNode) -> None:
        if self.write_policy == "write_back":
            # Its device slots are freed right after this: the copy must be complete.
            self._backup(node, wait=True)

    def _keep_on_host(self, node: TreeNode) -> bool:
        return node.host_value is not None

    def _delete(self, node: TreeNode) -> None:
        # A deleted node takes its host-only descendants with it.
        for child in list(node.children.values()):
            self._drop_host_subtree(child)
        node.children.clear()
        self._free_host(node)
        super()._delete(node)

    def _drop_host_subtree(self, node: TreeNode) -> None:
        assert node.value is None, "device nodes never hang below a deleted node"
        self.evicted_pages.record(node, self.page_size)
        for child in node.children.values():
            self._drop_host_subtree(child)
        self._free_host(node)

    def _free_host(self, node: TreeNode) -> None:
        if node.host_value is None:
            return
        # The L3 tier keeps slots a write still reads (write_back queues the write now).
        if self.storage is None or not self.storage.release(node):
            self.host_pool.free(node.host_value)
        self.host_cached_tokens -= len(node.key)
        node.host_value = None

    def evict_host(self, num_tokens: int) -> int:
        """Free host slots of host-only leaves, LRU first."""
        heap = [
            n
            for n in self.nodes()
            if n.value is None
            and not n.children
            and n.lock_ref == 0
            and not (
                self.storage is not None
                and n.host_value is not None
                and self.storage.busy(n.host_value)
            )
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)
            parent = node.parent
            freed += len(node.key)
            self._free_host(node)
            RadixCache._delete(self, node)
            if (
                parent is not None
                and parent is not self.root
                and parent.value is None
                and not parent.children
                and parent.lock_ref == 0
            ):
                heapq.heappush(heap, parent)
        self.counters["evicted_host_tokens_total"] += freed
        return freed

    def clear(self) -> bool:
        # Copies in flight first: a backup keeps its node locked, a load writes slots.
        self.transfer.wait_all()
        self.poll()
        if self.storage is not None:
            self.storage.drain()
        super().evict(self.cached_tokens)
        self.evict_host(self.host_cached_tokens)
        if self.storage is not None:
            self.storage.drain()  # write_back: what was just evicted lands, its slots free
        return self.cached_tokens == 0 and self.host_cached_tokens == 0

    # ------------------------------------------------------------------ load back
    def load_back(self, match: MatchResult) -> MatchResult:
        if match.host_len < max(self.load_threshold, 1):
            return match  # cheaper to recompute
        path: list[TreeNode] = []
        node = match.host_node
        while node is not match.device_node:
            path.append(node)
            assert node.parent is not None
            node = node.parent
        path.reverse()
        pages = self.allocator.pages_for(match.host_len)
        if pages > self.allocator.free_pages:
            # NOTE: making device room may back nodes up (write_back), which may evict
            # host-only leaves: the path being loaded must not be among them.
            self.lock(match.host_node)
            self.evict((pages - self.allocator.free_pages) * self.page_size)
            self.unlock(match.host_node)
        if pages > self.allocator.free_pages:
            return match  # no room on the device: the request recomputes instead
        device_slots = self.allocator.alloc_pages(pages)[: match.host_len]
        host_slots = torch.cat([n.host_value for n in path if n.host_value is not None])
        # NOTE: all or nothing: every node on the path gets device slots now; the copy runs
        # on the load stream and the next forward waits for it layer by layer
        # (take_load_handles), so the scheduler never blocks on it.
        handle = self.transfer.load_async(host_slots, device_slots)
        if not handle.done():
            self._loads_new.append(handle)
            self._loads_inflight.append(handle)
        offset = 0
        for node in path:
            n = len(node.key)
            node.value = device_slots[offset : offset + n].clone()
            assert node.parent is not None
            node.parent.device_children += 1
            offset += n
            self.cached_tokens += n
            if node.lock_ref > 0:
                self.protected_tokens += n
        self.counters["loadback_tokens_total"] += match.host_len
        self.counters["loadback_bytes_total"] += match.host_len * self.token_bytes
        return MatchResult(
            torch.cat([match.device_slots, device_slots]), match.host_node, 0, match.host_node
        )

    # ------------------------------------------------------------------ L3 prefetch
    def start_prefetch(self, match: MatchResult, key: list[int], salt: str = "") -> Prefetch | None:
        """Start reading the L3 pages that continue ``match`` along ``key`` under ``salt``
        (never blocks); None without a store or when nothing is worth looking up."""
        if self.storage is None:
            return None
        start = match.device_len + match.host_len
        return self.storage.start_prefetch(match.host_node, start, key[start:], salt)

    def prefetch_done(self, prefetch: Prefetch) -> bool:
        """Whether ``prefetch`` is decided (then ``finish_prefetch``); never blocks."""
        assert self.storage is not None
        return self.storage.advance(prefetch, self._alloc_host)

    def finish_prefetch(self, prefetch: Prefetch, key: list[int]) -> int:
        """Hang the pages ``prefetch`` read below the cached prefix of ``key`` as a
        host-only node; return how many tokens joined the tree."""
        assert self.storage is not None
        found = self.storage.finish(prefetch)
        if found is None:
            return 0
        tokens, host_slots = found
        # NOTE: the tree changed while the read ran: take the match again. The new node
        # continues it only if the prefix it was read for is still cached (else drop it);
        # tokens cached meanwhile (another request computed them) are not added twice.
        end = prefetch.start + len(tokens)
        match = self.match_prefix(key[:end], touch=False, salt=prefetch.salt)
        have = match.device_len + match.host_len
        if have < prefetch.start or have >= end:
            self.host_pool.free(host_slots)
            return 0
        skip = have - prefetch.start
        if skip:
            self.host_pool.free(host_slots[:skip])
        # match stopped at host_node because no child starts with the next page, so the
        # new node is a new child; it hangs below a device or host node as it must.
        node = TreeNode(tokens[skip:], None, match.host_node, prefetch.salt)
        node.host_value = host_slots[skip:]
        node.in_storage = True
        match.host_node.children[self._node_key(node)] = node
        self.host_cached_tokens += len(node.key)
        return len(node.key)

    def cancel_prefetch(self, prefetch: Prefetch) -> None:
        """Give up ``prefetch`` (its request left); its host slots come back."""
        assert self.storage is not None
        self.storage.cancel(prefetch)

    def _alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        """Host slots for ``num_tokens``, evicting host-only leaves if short; None if full."""
        slots = self.host_pool.alloc(num_tokens)
        if slots is None:
            self.evict_host(num_tokens)
            if self.storage is not None:
                self.storage.poll()  # writes that landed meanwhile give their slots back
            slots = self.host_pool.alloc(num_tokens)
        return slots

    def take_load_handles(self) -> list[Any]:
        self.poll()  # once per batch, decode-only phases included
        handles, self._loads_new = self._loads_new, []
        return handles

    def close(self) -> None:
        """Wait for every copy in flight (shutdown: the host buffer is released next)."""
        self.transfer.wait_all()
        self.poll()
        if self.storage is not None:
            self.storage.close()

    # ------------------------------------------------------------------ reporting
    def host_stats(self) -> dict[str, float]:
        stats: dict[str, float] = {
            "host_total": self.host_pool.capacity,
            "host_free": self.host_pool.available,
            "host_cached": self.host_cached_tokens,
        }
        stats.update(self.counters)
        if self.storage is not None:
            stats.update(self.storage.stats())
        return stats

    def check_host_invariants(self) -> None:
        held = sum(len(n.key) for n in self.nodes() if n.host_value is not None)
        assert held == self.host_cached_tokens, (held, self.host_cached_tokens)
        # Slots L3 prefetches read into, and slots that left the tree while an L3 write
        # reads them, belong to no node until the read is taken or the write lands.
        reading = self.storage.reading_tokens if self.storage is not None else 0
        writing = self.storage.releasing_tokens if self.storage is not None else 0
        total = self.host_pool.available + self.host_cached_tokens + reading + writing
        assert total == self.host_pool.capacity, (
            f"host accounting broken: free {self.host_pool.available} + cached "
            f"{self.host_cached_tokens} + L3 reads {reading} + L3 writes {writing} != "
            f"capacity {self.host_pool.capacity}"
        )
