"""Replay a cache trace through the engine's real prefix tree over simulated memory.

One page of the trace is one token of the simulated tree (page size 1): prompts that
share their first ``k`` page hashes share their first ``k`` tree tokens, so the tree,
its LRU eviction, write-through backups, host-only nodes and load-back behave as in the
server, while keys are ``page_size`` times shorter. Memory is simulated: the device and
host pools hold zero layers (no bytes), and copies between them finish at once.

Per request, in order of admission (a server's trace) or arrival (requests whose
``t_end`` has passed are released first):
match and lock the prompt's cached prefix, load host-only hits back (``load_back``, all
or nothing, under the load threshold it is recomputed), count stored (L3) pages that
continue the match, allocate the request's own pages (evicting as the manager does), and
at its finish insert its whole pages (prompt, then output) into the tree and unlock.

The L3 store is a page-hash LRU set of ``storage_pages``: write-through puts every page
the tree takes in; a prompt continuing its device/host match by at least the prefetch
threshold reads the stored pages that continue it.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from bench.whatif_lru import IndexedHiRadixCache, IndexedRadixCache
from bench.whatif_slots import slot_run
from engine.cache_trace import TraceRecord
from engine.kvcache.allocator import OutOfSlotsError, PageAllocator
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.hicache import HiRadixCache
from engine.kvcache.host_pool import HostKVPool
from engine.kvcache.radix_cache import RadixCache
from engine.kvcache.transfer import KVTransfer, TransferHandle
from engine.kvcache.tree_node import TreeNode
from engine.platform import parse_device

_CPU = parse_device("cpu")


@dataclass(frozen=True)
class SimConfig:
    """Tier sizes in tokens (as the server's flags count them) and the tier knobs."""

    page_size: int
    device_tokens: int
    host_tokens: int = 0  # 0: no host tier (RadixCache)
    storage_tokens: int = 0  # 0: no L3 store
    load_threshold: int = 16  # --hicache-load-threshold
    prefetch_threshold: int = 256  # --hicache-storage-prefetch-threshold
    write_policy: str = "write_through"


@dataclass
class SimResult:
    """Token totals of one replay; hit rates are shares of all prompt tokens."""

    config: SimConfig
    prompt_tokens: int = 0
    device_hit: int = 0
    host_hit: int = 0
    storage_hit: int = 0
    short_pages: int = 0  # pages a request could not get (the server would have waited)
    per_request: list[tuple[int, int, int]] = field(default_factory=list)

    def rate(self, tier: str) -> float:
        hit = {"device": self.device_hit, "host": self.host_hit, "storage": self.storage_hit}
        if tier == "total":
            return (self.device_hit + self.host_hit + self.storage_hit) / max(self.prompt_tokens, 1)
        return hit[tier] / max(self.prompt_tokens, 1)


class CountingAllocator(PageAllocator):
    """A device allocator that counts free pages instead of tracking which are free:
    the replay never reads KV, so the pages it hands out are slot runs (a length:
    bench/whatif_slots.py)."""

    def __init__(self, num_pages: int) -> None:
        super().__init__(1, 1)
        self.num_pages = num_pages
        self._num_free = num_pages

    @property
    def free_pages(self) -> int:
        return self._num_free

    @property
    def free_tokens(self) -> int:
        return self._num_free

    def alloc_pages(self, num_pages: int) -> torch.Tensor:
        if num_pages > self._num_free:
            raise OutOfSlotsError(f"asked for {num_pages} pages, {self._num_free} free")
        self._num_free -= num_pages
        return slot_run(num_pages)

    def free(self, slots: torch.Tensor) -> None:
        self._num_free += int(slots.numel())
        assert self._num_free <= self.num_pages, "page freed twice"


class CountingHostPool(HostKVPool):
    """A host tier of ``capacity`` pages that only counts them (no buffer, no copies;
    its slots are slot runs, as the device allocator's)."""

    def __init__(self, num_pages: int) -> None:  # no super().__init__: nothing to allocate
        self.num_pages = self.capacity = num_pages
        self.page_size = 1
        self._num_free = num_pages

    @property
    def available(self) -> int:
        return self._num_free

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        if num_tokens > self._num_free:
            return None
        self._num_free -= num_tokens
        return slot_run(num_tokens)

    def free(self, slots: torch.Tensor) -> None:
        self._num_free += int(slots.numel())
        assert self._num_free <= self.num_pages, "host page freed twice"


class _InstantTransfer(KVTransfer):
    """Copies between zero-byte pools: every handle is finished when returned."""

    def __init__(
        self, device_pool: DeviceKVPool, host_pool: HostKVPool
    ) -> None:  # no super().__init__: nothing to allocate
        self.device_pool, self.host_pool = device_pool, host_pool

    # Finished handles are never changed again: one of each serves every copy.
    _BACKUP = TransferHandle("backup", 0, 0, finished=True)
    _LOAD = TransferHandle("load", 0, 0, finished=True)

    def backup_async(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> TransferHandle:
        return self._BACKUP

    def load_async(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> TransferHandle:
        return self._LOAD


def build_tree(config: SimConfig, indexed: bool = True) -> tuple[RadixCache, PageAllocator]:
    """The real tree (HiCache when there is a host tier) over pools of zero bytes;
    ``indexed``: its LRU victims kept in heaps (bench/whatif_lru.py) and its pools
    counting slot runs (bench/whatif_slots.py), with the same choices; else the
    engine's own trees and pools over real slot tensors."""
    device_pages = max(config.device_tokens // config.page_size, 1)
    allocator: PageAllocator = (
        CountingAllocator(device_pages) if indexed else PageAllocator(device_pages, 1)
    )
    if config.host_tokens <= 0:
        return (IndexedRadixCache if indexed else RadixCache)(allocator), allocator
    device_pool = DeviceKVPool(0, allocator.num_slots, 1, 1, torch.float32, "cpu")
    host_pages = max(config.host_tokens // config.page_size, 1)
    host_pool = (
        CountingHostPool(host_pages)
        if indexed
        else HostKVPool(0, host_pages, 1, 1, torch.float32, _CPU, alloc_method="pageable")
    )
    load_pages = -(-config.load_threshold // config.page_size)
    tree = (IndexedHiRadixCache if indexed else HiRadixCache)(
        allocator,
        device_pool,
        host_pool,
        config.write_policy,
        load_pages,
        _CPU,
        None,
        _InstantTransfer(device_pool, host_pool),
    )
    return tree, allocator


@dataclass
class _Running:
    """A simulated request between its admission and its finish."""

    key: list[int]  # every whole page it leaves in KV, pseudo ids past the known ones
    slots: torch.Tensor  # device slots of its pages (prefix, then its own)
    prefix_pages: int
    last_node: TreeNode


class Replay:
    """One replay of a trace at one ``SimConfig``."""

    def __init__(self, config: SimConfig, indexed: bool = True) -> None:
        self.config = config
        self.tree, self.allocator = build_tree(config, indexed)
        self.storage_pages = config.storage_tokens // config.page_size
        self.stored: OrderedDict[int, None] = OrderedDict()  # L3: page hash -> LRU order
        self.result = SimResult(config)
        self._fresh = itertools.count(1)  # output pages the trace has no hash for

    def run(self, records: list[TraceRecord]) -> SimResult:
        with _rare_gc():
            return self._run(records)

    def _run(self, records: list[TraceRecord]) -> SimResult:
        order = sorted(range(len(records)), key=lambda i: records[i].start)
        running: list[tuple[float, int, _Running]] = []
        for i in order:
            record = records[i]
            while running and running[0][0] <= record.start:
                self._release(heapq.heappop(running)[2])
            heapq.heappush(running, (record.t_end, i, self._admit(record)))
        while running:
            self._release(heapq.heappop(running)[2])
        return self.result

    def _admit(self, record: TraceRecord) -> _Running:
        page = self.config.page_size
        # The last prompt token is always computed (its logits), so never matched.
        match_pages = min(record.prompt_pages, (record.prompt_len - 1) // page)
        kv_len = record.prompt_len + max(record.output_len - 1, 0)
        key = record.pages[: kv_len // page]
        key += [-next(self._fresh) for _ in range(kv_len // page - len(key))]
        tree = self.tree
        match = tree.match_prefix(key[:match_pages])
        tree.lock(match.device_node)
        device_hit = match.device_len
        if match.host_len > 0:
            loaded = tree.load_back(match)
            if loaded.device_node is not match.device_node:
                tree.lock(loaded.device_node)
                tree.unlock(match.device_node)
                match = loaded
        host_hit = match.device_len - device_hit
        storage_hit = self._read_storage(key, match.device_len, match_pages)
        prefix = match.device_len
        own = -(-kv_len // page) - prefix
        short = own - self.allocator.free_pages
        if short > 0:
            tree.evict(short)
        take = min(own, self.allocator.free_pages)
        self.result.short_pages += own - take
        slots = torch.cat([match.device_slots, self.allocator.alloc_pages(take)])
        result = self.result
        result.prompt_tokens += record.prompt_len
        result.device_hit += device_hit * page
        result.host_hit += host_hit * page
        result.storage_hit += storage_hit * page
        result.per_request.append((device_hit * page, host_hit * page, storage_hit * page))
        return _Running(key, slots, prefix, match.device_node)

    def _read_storage(self, key: list[int], start: int, match_pages: int) -> int:
        """Stored pages continuing the match at ``start`` (counted, LRU-touched)."""
        if not self.storage_pages:
            return 0
        if (match_pages - start) * self.config.page_size < self.config.prefetch_threshold:
            return 0
        found = 0
        for page_hash in key[start:match_pages]:
            if page_hash not in self.stored:
                break
            self.stored.move_to_end(page_hash)
            found += 1
        return found

    def _release(self, request: _Running) -> None:
        aligned = min(len(request.key), int(request.slots.numel()))
        slots = request.slots
        if aligned > request.prefix_pages:
            already = self.tree.insert(request.key[:aligned], slots[:aligned])
            if already > request.prefix_pages:
                self.allocator.free(slots[request.prefix_pages : already])
            self._write_storage(request.key[:aligned])
        if slots.numel() > aligned:
            self.allocator.free(slots[max(aligned, request.prefix_pages) :])
        self.tree.unlock(request.last_node)

    def _write_storage(self, pages: list[int]) -> None:
        if not self.storage_pages:
            return
        stored = self.stored
        for page_hash in pages:
            stored[page_hash] = None
            stored.move_to_end(page_hash)
        while len(stored) > self.storage_pages:
            stored.popitem(last=False)


@contextlib.contextmanager
def _rare_gc() -> Iterator[None]:
    """Collect cycles rarely while replaying: the trace and the growing tree are
    long-lived while every request allocates short-lived objects, so the default
    thresholds rescan them over and over (about a sixth of a 100k-request replay's CPU).
    The objects that exist already (the trace) are frozen out of every collection."""
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def replay(records: list[TraceRecord], config: SimConfig) -> SimResult:
    """Replay ``records`` at ``config`` (one grid point)."""
    return Replay(config).run(records)


def ideal_hits(records: list[TraceRecord], page_size: int) -> int:
    """Prompt tokens an unbounded cache of whole pages serves (page-granular ideal)."""
    seen: set[int] = set()
    hit = 0
    for record in sorted(records, key=lambda r: r.start):
        match_pages = min(record.prompt_pages, (record.prompt_len - 1) // page_size)
        n = 0
        for page_hash in record.pages[:match_pages]:
            if page_hash not in seen:
                break
            n += 1
        hit += n * page_size
        kv_len = record.prompt_len + max(record.output_len - 1, 0)
        seen.update(record.pages[: kv_len // page_size])
    return hit
