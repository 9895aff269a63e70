"""HiCache's L3 tier: host copies written to a store in the background, prefetched back.

Writes: once a tree node's KV is on the host tier, its full pages are queued for the
store; a writer thread sends them, and until the engine thread sees the write
acknowledged those host pages count as busy: host eviction passes them by. Under
``write_back`` the write is queued when the host copy is evicted instead. A page that
leaves the tree while a write reads it is freed once that write lands
(``releasing_tokens``): the engine thread never waits for the store.

Reads: when a request is a candidate for admission, the full pages of its prompt after
its device and host match are looked up in the store and read into fresh host pages
(``Prefetch``) on a reader thread. The request waits in the queue meanwhile, and the
engine thread only polls (``advance``), so other requests keep running. Once the read
is done, or its policy's deadline passed, the pages that landed join the tree as
host-only nodes; HiCache then loads them to the device like any host hit. A lookup
slower than the deadline, a store that is down, a corrupt page: each is a miss and the
request recomputes. Nothing the store does changes an output.

NOTE: pages a read given up on may still write into stay allocated (orphaned) until
that read ends.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.kvcache.host_pool import HostKVPool
from engine.kvcache.storage.base import KVStore
from engine.kvcache.storage.keys import chain_start, page_keys
from engine.kvcache.storage.prefetch import Prefetch
from engine.kvcache.tree_node import TreeNode

logger = logging.getLogger("hiserve.hicache")

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# Pages waiting for the writer; past this, new writes are dropped (counted), never block.
WRITE_QUEUE_PAGES = 4096
# After a store call times out or fails, the store is left alone this long (doubling on
# each failure in a row, up to the maximum), so a dead store costs one timeout, not one
# per request.
BACKOFF_S, BACKOFF_MAX_S = 2.0, 60.0


class StorageTier:
    """The store below one HiCache host tier, with its key chain and writer thread."""

    def __init__(
        self,
        store: KVStore,
        namespace: str,
        host_pool: HostKVPool,
        write_policy: str = "write_through",
        prefetch_policy: str = "timeout",
        prefetch_threshold: int = 256,
        timeout_base_s: float = 1.0,
        timeout_per_ki_token_s: float = 0.25,
    ) -> None:
        if prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(
                f"prefetch policy {prefetch_policy!r} is not valid; one of {PREFETCH_POLICIES}"
            )
        self.store, self.namespace, self.host_pool = store, namespace, host_pool
        self.page_size = host_pool.page_size
        self.write_policy, self.prefetch_policy = write_policy, prefetch_policy
        self.prefetch_threshold = max(prefetch_threshold, self.page_size)
        self.timeout_base_s, self.timeout_per_ki_token_s = timeout_base_s, timeout_per_ki_token_s
        store.register_host_pool(host_pool.page_pieces, host_pool.page_nbytes)
        register = getattr(store, "register_buffer", None)
        if register is not None:
            register(host_pool.kv_buffer.data_ptr(), host_pool.nbytes)
        self.counters = dict.fromkeys(
            (
                "storage_write_tokens_total",
                "storage_write_failed_tokens_total",
                "storage_write_dropped_tokens_total",
                "storage_prefetch_tokens_total",
                "storage_prefetch_miss_total",
            ),
            0,
        )
        self._busy: Counter[int] = Counter()  # host page id -> writes in flight reading it
        self._writes: queue.Queue[tuple[TreeNode, list[str], list[int]] | None] = queue.Queue()
        self._acks: queue.SimpleQueue[tuple[TreeNode, list[int], int]] = queue.SimpleQueue()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="hiserve-l3-read")
        self._reading: list[Prefetch] = []  # prefetches whose read holds host slots
        self._orphans: list[tuple[Future, torch.Tensor]] = []  # given-up reads, their slots
        self._releasing: list[torch.Tensor] = []  # host slots freed once no write reads them
        self._down_until = 0.0  # monotonic time before which the store is not asked
        self._backoff_s = BACKOFF_S
        self._writer = threading.Thread(target=self._write_loop, name="hiserve-l3-write")
        self._writer.daemon = True
        self._writer.start()

    # ------------------------------------------------------------------ keys
    def last_key(self, node: TreeNode) -> str | None:
        """Key of the last page of ``node`` (None for the root): the prior of its children.

        NOTE: a page's key depends only on the tokens from the root to its end, so it
        survives node splits; it is computed once per node."""
        if node.parent is None:
            return None
        if node.storage_key is None:
            node.storage_key = self.node_keys(node)[-1]
        return node.storage_key

    def node_keys(self, node: TreeNode) -> list[str]:
        assert node.parent is not None
        prior = self._prior(node.parent, node.salt)
        return page_keys(self.namespace, node.key, self.page_size, prior)

    def _prior(self, parent: TreeNode, salt: str) -> str | None:
        """The key before the first page of a child of ``parent`` under ``salt``: the
        parent's last key, or at the root the start of that salt's chain."""
        if parent.parent is None:
            return chain_start(self.namespace, salt)
        return self.last_key(parent)

    def _host_pages(self, host_slots: torch.Tensor) -> list[int]:
        return (host_slots[:: self.page_size] // self.page_size).tolist()

    # ------------------------------------------------------------------ writes
    def on_host_copy(self, node: TreeNode) -> None:
        """``node``'s KV just landed on the host tier: store it (unless write_back)."""
        if self.write_policy != "write_back":
            self._enqueue(node)

    def busy(self, host_slots: torch.Tensor) -> bool:
        """Whether a write in flight still reads any of these host slots."""
        return bool(self._busy) and any(self._busy[p] for p in self._host_pages(host_slots))

    def release(self, node: TreeNode) -> bool:
        """``node`` leaves the host tier; under ``write_back`` its pages not yet stored are
        queued for the writer now. True: the tier took its host slots and frees them once
        every write reading them is acknowledged (``releasing_tokens`` meanwhile); False:
        nothing reads them, the caller frees them at once.

        NOTE: never waits for the store: the engine thread goes on while the page is
        written, and the page stays readable until then."""
        assert node.host_value is not None
        if self.write_policy == "write_back" and not self.down:
            self._enqueue(node)
        if not self.busy(node.host_value):
            return False
        self._releasing.append(node.host_value)
        return True

    @property
    def releasing_tokens(self) -> int:
        """Host slots of pages that left the tree and wait for their write to land."""
        return sum(int(slots.numel()) for slots in self._releasing)

    def _enqueue(self, node: TreeNode) -> None:
        if node.in_storage or node.host_value is None:
            return
        pages = self._host_pages(node.host_value)
        if sum(self._busy.values()) + len(pages) > WRITE_QUEUE_PAGES:
            self.counters["storage_write_dropped_tokens_total"] += len(node.key)
            return
        self._busy.update(pages)
        self._writes.put((node, self.node_keys(node), pages))

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                node, keys, pages = item
                done = [False] * len(keys)
                if not self.down:
                    try:
                        done = self.store.put_from(keys, pages)
                    except Exception:  # a backend bug must not kill the writer
                        logger.exception("L3 write failed")
                    self._judge(any(done))
                self._acks.put((node, pages, sum(done)))
            finally:
                self._writes.task_done()

    def poll(self) -> None:
        """Engine thread: release pages whose write was acknowledged (freeing those that
        left the tree) and the slots of orphaned reads that ended."""
        while True:
            try:
                node, pages, pages_done = self._acks.get_nowait()
            except queue.Empty:
                break
            self._busy.subtract(pages)
            self._busy = +self._busy  # drop zero counts
            self._count_write(node, len(pages), pages_done)
        writing = []
        for slots in self._releasing:
            if self.busy(slots):
                writing.append(slots)
            else:
                self.host_pool.free(slots)
        self._releasing = writing
        still = []
        for future, slots in self._orphans:
            if future.done():
                self.host_pool.free(slots)
            else:
                still.append((future, slots))
        self._orphans = still

    def _count_write(self, node: TreeNode, pages: int, pages_done: int) -> None:
        node.in_storage = node.in_storage or pages_done == pages
        self.counters["storage_write_tokens_total"] += pages_done * self.page_size
        self.counters["storage_write_failed_tokens_total"] += (pages - pages_done) * self.page_size

    def drain(self) -> None:
        """Block until every queued write is done and acknowledged."""
        self._writes.join()
        self.poll()

    # ------------------------------------------------------------------ reads
    def start_prefetch(
        self, parent: TreeNode, start: int, tokens: Sequence[int], salt: str = ""
    ) -> Prefetch | None:
        """Look up the stored pages that continue ``parent`` (``start`` tokens deep) with
        ``tokens`` under cache_salt digest ``salt``; None when the run is too short to be
        worth it or the store is down.

        Never blocks: the lookup runs on the reader thread; ``advance`` moves it on."""
        num_pages = len(tokens) // self.page_size
        if num_pages * self.page_size < self.prefetch_threshold or self.down:
            return None
        run = list(tokens[: num_pages * self.page_size])
        keys = page_keys(self.namespace, run, self.page_size, self._prior(parent, salt))
        timeout = self._timeout(len(run))
        deadline = None if timeout is None else time.monotonic() + timeout
        prefetch = Prefetch(start, run, keys, deadline, salt)
        prefetch.lookup = self._reader.submit(self.store.exists_prefix, keys)
        return prefetch

    def advance(self, prefetch: Prefetch, alloc_host: Callable[[int], torch.Tensor | None]) -> bool:
        """Engine thread: move ``prefetch`` on without waiting; True once it is decided
        (read whole, found nothing, failed or past its deadline): call ``finish`` next."""
        if prefetch.read is not None:
            return prefetch.read.done() or prefetch.overdue
        assert prefetch.lookup is not None
        if not prefetch.lookup.done():
            if prefetch.overdue:
                prefetch.miss_reason = "lookup timed out"
                prefetch.late = (prefetch.start, prefetch.start + len(prefetch.tokens))
                self._judge(False)
            return prefetch.overdue
        try:
            hits = prefetch.lookup.result()
        except Exception as exc:
            self._judge(False)
            prefetch.miss_reason = f"lookup failed: {exc}"
            prefetch.late = (prefetch.start, prefetch.start + len(prefetch.tokens))
            return True
        if hits * self.page_size < self.prefetch_threshold:
            return True  # a plain miss
        slots = alloc_host(hits * self.page_size)
        if slots is None:
            prefetch.miss_reason = "no room on the host tier"
            return True
        prefetch.slots = slots
        self._reading.append(prefetch)
        prefetch.read = self._reader.submit(
            prefetch.read_pages, self.store, self._host_pages(slots)
        )
        return False

    def finish(self, prefetch: Prefetch) -> tuple[list[int], torch.Tensor] | None:
        """End a decided ``prefetch``: (tokens that landed, their host slots, now owned by
        the caller), or None on a miss. Slots a read still in flight may write into stay
        held (``orphaned_tokens``) until it ends."""
        keep = 0
        if prefetch.slots is not None:
            self._reading.remove(prefetch)
            read = prefetch.read
            assert read is not None
            late = True
            if read.done() and read.exception() is not None:
                self._judge(False)
                prefetch.miss_reason = f"read failed: {read.exception()}"
            elif not read.done():  # past its deadline: take what has landed
                prefetch.cancelled = True
                if prefetch.landed == 0:
                    self._judge(False)
                    prefetch.miss_reason = "read timed out"
            else:
                late = False  # read whole, or the store lacked a page: not a late read
                self._judge(prefetch.landed > 0)
            keep = prefetch.landed * self.page_size
            if keep < self.prefetch_threshold:
                keep = 0
            if late:
                hits = int(prefetch.slots.numel())
                prefetch.late = (prefetch.start + keep, prefetch.start + hits)
            self._release_unread(prefetch, keep)
        if keep == 0:
            self._miss(prefetch.miss_reason)
            return None
        assert prefetch.slots is not None
        self.counters["storage_prefetch_tokens_total"] += keep
        return prefetch.tokens[:keep], prefetch.slots[:keep]

    def cancel(self, prefetch: Prefetch) -> None:
        """Drop ``prefetch`` (its request was aborted): its slots go back to the host tier
        (once a read in flight ends)."""
        prefetch.cancelled = True
        if prefetch.slots is not None:
            self._reading.remove(prefetch)
            self._release_unread(prefetch, 0)

    def _release_unread(self, prefetch: Prefetch, keep: int) -> None:
        """Free the slots of ``prefetch`` past ``keep``, or orphan them while it reads."""
        assert prefetch.slots is not None and prefetch.read is not None
        rest = prefetch.slots[keep:]
        if rest.numel() == 0:
            return
        if prefetch.read.done():
            self.host_pool.free(rest)
        else:
            self._orphans.append((prefetch.read, rest))

    @property
    def down(self) -> bool:
        """Whether the store is being left alone after failing (see BACKOFF_S)."""
        return time.monotonic() < self._down_until

    def _judge(self, worked: bool) -> None:
        """Record how a store call went: a failure starts (or doubles) the backoff."""
        if worked:
            self._backoff_s = BACKOFF_S
            return
        if not self.down:
            logger.warning(
                "L3 %s store is failing or slow; not asking it for %.0f s (requests recompute)",
                self.store.name,
                self._backoff_s,
            )
        self._down_until = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, BACKOFF_MAX_S)

    @property
    def orphaned_tokens(self) -> int:
        """Host slots held by reads that were given up on and have not ended yet."""
        return sum(int(slots.numel()) for _, slots in self._orphans)

    @property
    def reading_tokens(self) -> int:
        """Host slots of prefetches in flight plus orphaned reads: owned by no tree node."""
        held = sum(int(p.slots.numel()) for p in self._reading if p.slots is not None)
        return held + self.orphaned_tokens

    def _timeout(self, num_tokens: int) -> float | None:
        if self.prefetch_policy == "wait_complete":
            return None
        if self.prefetch_policy == "best_effort":
            return self.timeout_base_s / 10
        return self.timeout_base_s + self.timeout_per_ki_token_s * num_tokens / 1024

    def _miss(self, why: str | None) -> None:
        self.counters["storage_prefetch_miss_total"] += 1
        if why:
            logger.info("L3 prefetch: %s; recomputing", why)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Finish queued writes, stop the threads, close the store."""
        self.drain()
        self._writes.put(None)
        self._writer.join(timeout=30)
        for prefetch in self._reading:
            prefetch.cancelled = True  # a read stops after its current chunk
        self._reader.shutdown(wait=True, cancel_futures=True)
        self.poll()
        self.store.close()

    def stats(self) -> dict[str, float]:
        stats: dict[str, float] = dict(self.counters)
        stats["storage_write_queue_pages"] = sum(self._busy.values())
        # Writes the writer has not finished (the engine thread may not have seen the acks).
        stats["storage_writes_pending"] = self._writes.unfinished_tasks
        store = self.store.stats  # NOTE: ints the store's threads bump; read without a lock
        stats["storage_pages_rejected_total"] = store.pages_rejected
        stats["storage_pages_evicted_total"] = store.pages_evicted
        stats["storage_writes_refused_total"] = store.writes_refused
        stats["storage_used_bytes"] = store.used_bytes
        return stats
