"""Who owns which KV slot: the allocator, the request table and the prefix cache together."""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from engine.kvcache.allocator import OutOfSlotsError, PageAllocator
from engine.kvcache.evicted_pages import end_digest
from engine.kvcache.miss_reasons import MissReasons, attribute
from engine.kvcache.req_table import ReqTable
from engine.kvcache.tree_base import MatchResult, PrefixTree
from engine.request import Req


class KVCacheManager:
    """Slot bookkeeping for running requests over one device pool.

    NOTE: a running request owns the pages covering ``[prefix_len, kv_len)`` of its
    tokens (``prefix_len`` is page-aligned); ``[0, prefix_len)`` belongs to locked tree
    nodes. Hence ``allocator.free_tokens + sum(owned) + tree.cached_tokens == capacity``.
    """

    def __init__(self, allocator: PageAllocator, req_table: ReqTable, tree: PrefixTree) -> None:
        self.allocator = allocator
        self.req_table = req_table
        self.tree = tree
        self.page_size = allocator.page_size
        self._prefetches: dict[str, Any] = {}  # request id -> its L3 prefetch in flight
        self._from_storage: dict[str, int] = {}  # request id -> tokens its prefetch added
        # request id -> prompt positions its prefetch asked the store for in vain
        self._late: dict[str, tuple[int, int]] = {}

    # ------------------------------------------------------------------ sizes
    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def available_tokens(self) -> int:
        """Free plus evictable device tokens."""
        return self.allocator.free_tokens + self.tree.evictable_tokens

    def owned_tokens(self, req: Req) -> int:
        return self.allocator.pages_for(req.kv_len - req.prefix_len) * self.page_size

    def new_tokens_cost(self, req: Req, num_tokens: int) -> int:
        """Device tokens (whole pages) that growing ``req`` by ``num_tokens`` takes."""
        have = self.owned_tokens(req) - (req.kv_len - req.prefix_len)
        extra = max(0, num_tokens - have)
        return self.allocator.pages_for(extra) * self.page_size

    # ------------------------------------------------------------------ admission
    def admit(self, req: Req, match: MatchResult | None = None) -> None:
        """Give ``req`` a table row and lock its longest cached prefix. ``match``: the
        result of ``match(req)`` just before, if the caller has it (nothing may change
        the tree in between); it is then not matched a second time."""
        req.row = self.req_table.alloc_row()
        if match is None:
            match = self.tree.match_prefix(self._match_key(req), salt=req.cache_salt)
        else:
            self.tree.touch(match)
        # Lock before any load-back: its allocation may evict, never our own prefix.
        self.tree.lock(match.device_node)
        device_hit, host_len = match.device_len, match.host_len
        from_storage = self._from_storage.pop(req.request_id, 0)
        late = self._late.pop(req.request_id, None)
        if match.host_len > 0:
            loaded = self.tree.load_back(match)
            if loaded.device_node is not match.device_node:
                self.tree.lock(loaded.device_node)
                self.tree.unlock(match.device_node)
                match = loaded
        req.last_node = match.device_node
        req.prefix_len = req.kv_len = match.device_len
        self.req_table.write(req.row, 0, match.device_slots)
        if not req.reported_cache:
            # Load-back is all or nothing: the stored tail arrived only if everything did.
            loaded_len = match.device_len - device_hit
            req.cached_device = device_hit
            req.cached_storage = from_storage if loaded_len >= from_storage else 0
            req.cached_host = loaded_len - req.cached_storage
            left = (device_hit, device_hit + host_len) if host_len and not loaded_len else None
            req.miss_reasons = self._miss_reasons(req, match.device_len, left, late)
            req.reported_cache = True
            req.admit_time = time.monotonic()

    def _miss_reasons(
        self,
        req: Req,
        cached_len: int,
        not_loaded: tuple[int, int] | None,
        late: tuple[int, int] | None,
    ) -> MissReasons:
        """Why the prompt tokens of a just-admitted ``req`` past its ``cached_len`` cached
        ones missed (engine/kvcache/miss_reasons.py). ``req.last_node`` ends the cached
        prefix; the evicted pages are looked for after the host and store spans."""
        key = self._match_key(req)
        cacheable = len(key) - len(key) % self.page_size
        resume = cached_len
        for span in (not_loaded, late):
            if span is not None and span[0] <= resume:
                resume = max(resume, min(span[1], cacheable))
        prior = end_digest(req.last_node, self.page_size, req.cache_salt)
        seen = self.tree.evicted_pages.seen_len(
            prior, key[cached_len:cacheable], self.page_size, skip=resume - cached_len
        )
        return attribute(
            len(req.prompt_ids), cacheable, cached_len, (resume, resume + seen), not_loaded, late
        )

    # ------------------------------------------------------------------ L3 prefetch
    def prefetch_ready(self, req: Req, match: MatchResult) -> MatchResult | None:
        """Whether ``req`` may be admitted as far as the L3 store goes: None while its
        prefetch is in flight (it waits in the queue; nothing blocks), else the match to
        admit it with (taken again when stored pages joined the tree).

        NOTE: the first call starts the prefetch; a request prefetches once per stay in
        the queue: the tokens it added are kept for ``admit`` to report.
        """
        if req.request_id in self._from_storage:
            return match
        key = self._match_key(req)
        prefetch = self._prefetches.get(req.request_id)
        if prefetch is None:
            prefetch = self.tree.start_prefetch(match, key, req.cache_salt)
            if prefetch is None:
                return match
            self._prefetches[req.request_id] = prefetch
        if not self.tree.prefetch_done(prefetch):
            return None
        del self._prefetches[req.request_id]
        added = self.tree.finish_prefetch(prefetch, key)
        self._from_storage[req.request_id] = added
        if prefetch.late is not None:
            self._late[req.request_id] = prefetch.late
        if not added:
            return match
        return self.tree.match_prefix(key, touch=False, salt=req.cache_salt)

    def drop_prefetch(self, req: Req) -> None:
        """``req`` left the queue for good: give up its prefetch, if any."""
        self._from_storage.pop(req.request_id, None)
        self._late.pop(req.request_id, None)
        prefetch = self._prefetches.pop(req.request_id, None)
        if prefetch is not None:
            self.tree.cancel_prefetch(prefetch)

    def wait_prefetches(self, timeout: float) -> None:
        """Block up to ``timeout`` s for a store call of a prefetch in flight (the engine
        calls this when nothing else is runnable, rather than spin)."""
        futures = [f for p in self._prefetches.values() for f in p.futures]
        if futures:
            wait_futures(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    @staticmethod
    def _match_key(req: Req) -> list[int]:
        # NOTE: a request scoring its prompt needs logits at every prompt position, and
        # the tree keeps KV, not logits: it matches nothing and computes the whole prompt
        # (one prefill). Its pages still land in the tree for later requests.
        if req.scoring_prompt:
            return []
        # The last token must be computed to get logits, so never match all of it.
        return req.all_ids[: req.seq_len - 1]

    def match(self, req: Req) -> MatchResult:
        """``req``'s longest cached prefix, without locking or touching anything."""
        return self.tree.match_prefix(self._match_key(req), touch=False, salt=req.cache_salt)

    def peek_prefix_len(self, req: Req) -> int:
        """Device-cached prefix length without locking (for the lpm policy)."""
        return self.match(req).device_len

    # ------------------------------------------------------------------ growth
    def alloc(self, req: Req, num_tokens: int) -> torch.Tensor:
        """Slots for tokens ``[kv_len, kv_len + num_tokens)`` of ``req``; bumps kv_len.

        Evicts unlocked cache leaves when the free list is short; raises OutOfSlotsError
        when even that is not enough (the caller retracts or waits).
        """
        page = self.page_size
        start = req.kv_len
        parts: list[torch.Tensor] = []
        used_in_page = (start - req.prefix_len) % page
        if used_in_page:
            # Fill the rest of the request's current partial page first.
            last = self.req_table.slot(req.row, start - 1)  # the CPU mirror: no sync
            take = min(page - used_in_page, num_tokens)
            parts.append(torch.arange(last + 1, last + 1 + take, dtype=torch.int64))
        remaining = num_tokens - sum(p.numel() for p in parts)
        if remaining > 0:
            num_pages = self.allocator.pages_for(remaining)
            short = num_pages - self.allocator.free_pages
            if short > 0:
                self.tree.evict(short * page)
            if num_pages > self.allocator.free_pages:
                raise OutOfSlotsError(
                    f"need {num_pages} KV pages, {self.allocator.free_pages} free after eviction"
                )
            parts.append(self.allocator.alloc_pages(num_pages)[:remaining])
        slots = torch.cat(parts) if len(parts) > 1 else parts[0]
        self.req_table.write(req.row, start, slots)
        req.kv_len = start + num_tokens
        return slots

    def alloc_decode(self, reqs: list[Req]) -> torch.Tensor:
        """One slot each for the next token of every request in ``reqs`` (a decode
        step), ``[B]`` int64 in their order; bumps each kv_len by one.

        A fixed number of tensor operations for the whole step, whatever B is. All or
        nothing: evicts unlocked cache leaves when the free list is short, and raises
        OutOfSlotsError, having changed nothing, when even that is not enough.
        """
        page = self.page_size
        # A request whose owned tokens fill whole pages opens a new page; the rest
        # continue their partial page.
        opens = [(r.kv_len - r.prefix_len) % page == 0 for r in reqs]
        num_pages = sum(opens)
        short = num_pages - self.allocator.free_pages
        if short > 0:
            self.tree.evict(short * page)
            if num_pages > self.allocator.free_pages:
                raise OutOfSlotsError(
                    f"need {num_pages} KV pages, {self.allocator.free_pages} free after eviction"
                )
        meta = torch.tensor([[r.row for r in reqs], [r.kv_len for r in reqs]], dtype=torch.int64)
        rows, columns = meta.unbind(0)  # [B] each
        if num_pages == len(reqs):  # every row opens a page (each step at page size 1)
            slots = self.allocator.alloc_page_ids(num_pages) * page  # [B]
        else:
            # Continuing a page: the slot after the previous token's (the CPU mirror: no
            # sync). A row that opens a page reads a column it overwrites below.
            slots = self.req_table.cpu[rows, columns - 1].to(torch.int64) + 1  # [B]
            if num_pages:
                slots[torch.tensor(opens)] = self.allocator.alloc_page_ids(num_pages) * page
        self.req_table.write_cells(rows, columns, slots)
        for req in reqs:
            req.kv_len += 1
        return slots

    # ------------------------------------------------------------------ landing
    def cache_prefix(self, req: Req) -> None:
        """Hand the computed whole pages of a still-running ``req`` to the tree, so other
        requests with the same prefix (the copies of an n > 1 request) reuse them now.

        NOTE: afterwards ``[0, prefix_len)`` is again exactly the locked tree path and the
        request owns only its last partial page; where the tree already held a page, the
        request's duplicate is freed and its table row points at the tree's slots.
        """
        if not self.tree.enabled or req.row < 0:
            return
        kv_len = req.kv_len
        aligned = kv_len - (kv_len - req.prefix_len) % self.page_size
        if aligned <= req.prefix_len:
            return
        key = req.all_ids[:aligned]
        slots = self.req_table.read(req.row, 0, aligned)
        already = self.tree.insert(key, slots, req.cache_salt)
        if already > req.prefix_len:
            self.allocator.free(slots[req.prefix_len : already])
        match = self.tree.match_prefix(key, touch=False, salt=req.cache_salt)
        assert match.device_len == aligned, "a just-inserted prefix must match in full"
        self.tree.lock(match.device_node)
        self.tree.unlock(req.last_node)
        req.last_node = match.device_node
        self.req_table.write(req.row, 0, match.device_slots)
        req.prefix_len = aligned

    # ------------------------------------------------------------------ release
    def release(self, req: Req) -> None:
        """Hand a leaving request's KV to the tree (or free it) and unlock its prefix."""
        if req.row < 0:
            return
        kv_len = req.kv_len
        slots = self.req_table.read(req.row, 0, kv_len)
        page = self.page_size
        aligned = kv_len - (kv_len - req.prefix_len) % page if self.tree.enabled else req.prefix_len
        if self.tree.enabled and aligned > req.prefix_len:
            already = self.tree.insert(req.all_ids[:aligned], slots[:aligned], req.cache_salt)
            # Tokens the tree already held were computed twice; drop this copy.
            if already > req.prefix_len:
                self.allocator.free(slots[req.prefix_len : already])
        if kv_len > aligned:
            self.allocator.free(slots[aligned:kv_len])
        self.tree.unlock(req.last_node)
        self.req_table.free_row(req.row)
        req.row = -1
        req.last_node = None
        req.kv_len = req.prefix_len = 0

    # ------------------------------------------------------------------ checks
    def check_invariants(self, running: list[Req]) -> None:
        """``free + owned + cached == capacity`` (tests call this after every step)."""
        owned = sum(self.owned_tokens(r) for r in running if r.row >= 0)
        total = self.allocator.free_tokens + owned + self.tree.cached_tokens
        # Lock balance: every lock on a node comes from a running request on its path
        # (or an in-flight host-tier backup, which holds its own lock).
        expected: dict[int, int] = {}
        for r in running:
            node = r.last_node
            while node is not None and node is not self.tree.root:
                expected[node.id] = expected.get(node.id, 0) + 1
                node = node.parent
        if not self.tree.backups_in_flight:
            for node in self.tree.nodes():
                if node.lock_ref != expected.get(node.id, 0):
                    raise AssertionError(
                        f"lock leak: node {node.id} has lock_ref {node.lock_ref}, "
                        f"running requests account for {expected.get(node.id, 0)}"
                    )
        self.tree.check_host_invariants()
        if total != self.capacity:
            raise AssertionError(
                f"KV accounting broken: free {self.allocator.free_tokens} + owned {owned} + "
                f"cached {self.tree.cached_tokens} = {total} != capacity {self.capacity}"
            )
