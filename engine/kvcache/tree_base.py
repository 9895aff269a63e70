"""The interface of a prefix tree as the KV manager and the engine see it (its node and
match types are in tree_node.py).

``RadixCache`` (engine/kvcache/radix_cache.py) is the device-only tree; ``HiRadixCache``
(engine/kvcache/hicache.py) adds the host tier (L2) and, through ``storage``, an L3
store. The tier hooks below have the defaults of a tree with no tier under the device:
nothing to load back, nothing to prefetch, no host statistics, nothing to close.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from engine.kvcache.evicted_pages import EvictedPages
from engine.kvcache.tree_node import MatchResult, TreeNode

if TYPE_CHECKING:
    from engine.kvcache.storage.tier import StorageTier


# What host_stats() reports for a tree without a host tier: every figure zero.
NO_HOST_STATS: dict[str, float] = dict.fromkeys(
    (
        "host_total",
        "host_free",
        "host_cached",
        "evicted_host_tokens_total",
        "backup_tokens_total",
        "backup_bytes_total",
        "loadback_tokens_total",
        "loadback_bytes_total",
    ),
    0,
)


class PrefixTree(ABC):
    """A prefix cache over KV slots: match, insert, lock, evict; plus the tier hooks."""

    enabled: bool
    root: TreeNode
    cached_tokens: int  # device tokens held by nodes
    protected_tokens: int  # device tokens held by locked nodes
    evicted_device_tokens: int
    # Pages dropped from every tier (digests, bounded): tells "evicted" from "never seen".
    evicted_pages: EvictedPages
    # The L3 tier below the host tier, if any (HiCache with --hicache-storage-backend).
    storage: StorageTier | None = None

    # ------------------------------------------------------------------ the tree
    @abstractmethod
    def match_prefix(self, key: list[int], touch: bool = True, salt: str = "") -> MatchResult: ...

    @abstractmethod
    def touch(self, match: MatchResult) -> None: ...

    @abstractmethod
    def insert(self, key: list[int], slots: torch.Tensor, salt: str = "") -> int: ...

    @abstractmethod
    def lock(self, node: TreeNode) -> None: ...

    @abstractmethod
    def unlock(self, node: TreeNode) -> None: ...

    @abstractmethod
    def nodes(self) -> Iterator[TreeNode]: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int: ...

    @abstractmethod
    def clear(self) -> bool: ...

    @property
    def evictable_tokens(self) -> int:
        return self.cached_tokens - self.protected_tokens

    # ------------------------------------------------------------------ tier hooks
    def load_back(self, match: MatchResult) -> MatchResult:
        """Bring the host-only part of ``match`` to the device.

        Returns a longer match on success, or ``match`` unchanged (then it is recomputed).
        """
        return match

    def take_load_handles(self) -> list[Any]:
        """Host-to-device copies issued since the last call; the next forward waits for
        each of them layer by layer before reading KV."""
        return []

    def start_prefetch(self, match: MatchResult, key: list[int], salt: str = "") -> Any:
        """Start reading stored (L3) pages that continue ``match`` (a match of ``key``
        under ``salt``); None: nothing to read."""
        return None

    def prefetch_done(self, prefetch: Any) -> bool:
        return True

    def finish_prefetch(self, prefetch: Any, key: list[int]) -> int:
        """Tokens a decided prefetch added to the tree."""
        return 0

    def cancel_prefetch(self, prefetch: Any) -> None:
        """Give up a prefetch whose request left."""
        return None  # a default, not an abstract method: no tier, nothing to do

    @property
    def backups_in_flight(self) -> bool:
        """Whether device -> host copies still hold locks on nodes (lock checks skip then)."""
        return False

    def host_stats(self) -> dict[str, float]:
        """Host tier (and L3) figures for /metrics; zeros without a host tier."""
        return dict(NO_HOST_STATS)

    def check_host_invariants(self) -> None:
        """Raise AssertionError if the host tier's accounting is broken (tests)."""
        return None  # a default, not an abstract method: no tier, nothing to do

    def close(self) -> None:
        """Wait for copies in flight and close the stores (shutdown)."""
        return None  # a default, not an abstract method: no tier, nothing to do
