"""The L3 storage interface: whole KV pages moved between the host tier and a store.

The host tier registers itself once with a function that returns, for a host page id,
the contiguous CPU tensors holding that page's bytes (two for a ``page_first`` pool: K
and V; two per layer for ``layer_first``). A store reads into and writes from those
tensors directly, so no page is copied through Python bytes on the way.

Every call is batch shaped and answers per page. A store that is down, slow, full or
corrupt answers "no" (a miss, a failed write), never raises: the caller recomputes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# Host page id -> the contiguous CPU tensors that hold its bytes, in a fixed order.
PagePieces = Callable[[int], list[torch.Tensor]]


def byte_view(piece: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy."""
    return memoryview(piece.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


@dataclass
class StoreStats:
    """What a store did since it was opened (pages and bytes, both directions)."""

    pages_written: int = 0
    pages_read: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_failures: int = 0
    read_failures: int = 0
    pages_evicted: int = 0
    pages_rejected: int = 0  # failed authentication (swapped, forged, cut short): a miss
    writes_refused: int = 0  # not written: the store's budget or the volume is full
    used_bytes: int = 0  # bytes the store holds, where it can tell (every writer's)


class KVStore(ABC):
    """An L3 store of KV pages keyed by ``keys.page_keys``."""

    name = "none"

    def __init__(self) -> None:
        self.stats = StoreStats()
        self._pieces: PagePieces | None = None
        self.page_nbytes = 0

    def register_host_pool(self, pieces: PagePieces, page_nbytes: int) -> None:
        """Give the store the host tier's page layout; called once before any I/O."""
        self._pieces, self.page_nbytes = pieces, page_nbytes

    def pieces(self, host_page: int) -> list[torch.Tensor]:
        if self._pieces is None:
            raise RuntimeError("register_host_pool() must be called before page I/O")
        return self._pieces(host_page)

    @abstractmethod
    def exists_prefix(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are stored whole."""

    @abstractmethod
    def get_into(self, keys: Sequence[str], host_pages: Sequence[int]) -> list[bool]:
        """Read page ``keys[i]`` into host page ``host_pages[i]``; True where it arrived
        whole and intact (a False page's host bytes are undefined)."""

    @abstractmethod
    def put_from(self, keys: Sequence[str], host_pages: Sequence[int]) -> list[bool]:
        """Store host page ``host_pages[i]`` as ``keys[i]``; True only once it is stored
        whole and visible to other readers (already stored counts as True)."""

    def clear(self) -> None:  # noqa: B027 - optional for stores without admin access
        """Remove every page this store can reach."""

    def close(self) -> None:  # noqa: B027 - optional for stores without resources
        """Release connections and files; the store is unusable afterwards."""
