"""One L3 prefetch in flight: a lookup, then a read of the hit pages in chunks.

The engine thread owns a ``Prefetch`` and polls it between steps; the reader thread runs
the store calls. The request it serves waits in the queue meanwhile, so the engine keeps
running other requests while the store answers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from engine.kvcache.storage.base import KVStore

# Pages per store read: after each chunk the pages read so far are usable, so a request
# admitted at its deadline takes what has landed and a cancelled read stops soon.
READ_CHUNK_PAGES = 8


class Prefetch:
    """The stored pages that may continue a cached prefix of ``start`` tokens.

    NOTE: ``slots`` (the host slots of the hit pages, once the lookup answered) belong to
    this prefetch until ``StorageTier.finish`` or ``cancel`` hands them on; ``landed`` is
    written by the reader thread only (an int store, read by the engine thread), and
    counts leading pages read whole, so ``slots[: landed * page_size]`` are never
    written again.
    """

    def __init__(
        self,
        start: int,
        tokens: list[int],
        keys: list[str],
        deadline: float | None,
        salt: str = "",
    ) -> None:
        self.salt = salt  # the cache_salt digest the pages were looked up under
        self.start = start  # prompt tokens cached before the stored run (device + host)
        self.tokens = tokens  # the page-aligned tokens after them that were looked up
        self.keys = keys  # their page keys
        self.deadline = deadline  # monotonic; None waits for everything (wait_complete)
        self.lookup: Future[int] | None = None
        self.read: Future[None] | None = None
        self.slots: torch.Tensor | None = None
        self.landed = 0
        self.cancelled = False
        self.miss_reason: str | None = None  # why it found nothing, for the log
        # Prompt positions [start, end) the store was asked for and did not deliver in
        # time (past the deadline, or a failed call): the storage_timeout miss reason.
        self.late: tuple[int, int] | None = None

    @property
    def overdue(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    @property
    def futures(self) -> list[Future]:
        """The store call this prefetch waits on now (none once it is decided)."""
        current = self.read if self.read is not None else self.lookup
        return [current] if current is not None and not current.done() else []

    def read_pages(self, store: KVStore, host_pages: Sequence[int]) -> None:
        """Reader thread: read the hit pages chunk by chunk, stopping at the first page
        that does not arrive whole or once cancelled."""
        for first in range(0, len(host_pages), READ_CHUNK_PAGES):
            if self.cancelled:
                return
            last = min(first + READ_CHUNK_PAGES, len(host_pages))
            arrived = store.get_into(self.keys[first:last], host_pages[first:last])
            run = arrived.index(False) if False in arrived else len(arrived)
            self.landed = first + run
            if run < last - first:
                return
