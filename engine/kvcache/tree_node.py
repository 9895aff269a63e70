"""A prefix tree's node and the result of matching a key against the tree."""

from __future__ import annotations

import itertools
import time
from typing import NamedTuple

import torch


class TreeNode:
    """One edge of the radix tree: ``key`` tokens and where their KV lives.

    ``value``: device slots (int64, CPU tensor) or None once evicted from the device.
    ``host_value``: host-tier slots or None (HiCache only).
    ``storage_key``: key of the node's last page in the L3 store, once computed;
    ``in_storage``: whether all its pages are known to be in that store (L3 only).
    ``digest``: page-chain digest of the prefix that ends with it, once computed
    (engine/kvcache/evicted_pages.py).
    ``salt``: digest of the cache_salt of the requests that made it ("" without one);
    every node of a subtree below the root has its root-level ancestor's salt.
    ``device_children``: how many of ``children`` have a ``value`` (kept by the tree
    wherever a child gains or loses device slots, or joins or leaves ``children``), so
    the device-leaf test is O(1) where a document node has hundreds of host-only
    children.
    """

    __slots__ = (
        "children",
        "device_children",
        "digest",
        "hit_count",
        "host_value",
        "id",
        "in_storage",
        "key",
        "last_access",
        "lock_ref",
        "parent",
        "salt",
        "storage_key",
        "value",
    )
    _ids = itertools.count()

    def __init__(
        self,
        key: list[int],
        value: torch.Tensor | None,
        parent: TreeNode | None,
        salt: str = "",
    ) -> None:
        self.key = key
        self.salt = salt
        self.value = value
        self.host_value: torch.Tensor | None = None
        self.parent = parent
        # first page of the child's key -> child; below the root a salted child's entry
        # is (salt, *page) instead (RadixCache._child_key)
        self.children: dict[tuple[int | str, ...], TreeNode] = {}
        self.device_children = 0
        self.lock_ref = 0
        self.last_access = time.monotonic()
        self.hit_count = 0
        self.storage_key: str | None = None
        self.in_storage = False
        self.digest: int | None = None
        self.id = next(TreeNode._ids)

    @property
    def on_device(self) -> bool:
        return self.value is not None

    @property
    def on_host(self) -> bool:
        return self.host_value is not None

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access < other.last_access


class MatchResult(NamedTuple):
    """Longest cached prefix of a key, split by tier."""

    device_slots: torch.Tensor  # [device_len] slots of the device-resident part
    device_node: TreeNode  # deepest device-resident matched node (root if none)
    host_len: int  # tokens after the device part that exist on the host tier only
    host_node: TreeNode  # deepest matched node overall (== device_node when host_len 0)

    @property
    def device_len(self) -> int:
        return int(self.device_slots.numel())
