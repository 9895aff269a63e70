"""The prefix tree's explicit interface (engine/kvcache/tree_base.py): the tier hooks have
their defaults in one place, HiCache overrides them, and nobody probes a tree with getattr."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from engine.kv_setup import KVSetup
from engine.kvcache.allocator import PageAllocator
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.hicache import HiRadixCache
from engine.kvcache.host_pool import HostKVPool
from engine.kvcache.manager import KVCacheManager
from engine.kvcache.radix_cache import RadixCache
from engine.kvcache.req_table import ReqTable
from engine.kvcache.tree_base import NO_HOST_STATS, PrefixTree
from engine.platform import DeviceSpec

ROOT = Path(__file__).resolve().parents[2]
CPU = DeviceSpec("cpu", None)
TIER_HOOKS = (
    "load_back",
    "take_load_handles",
    "start_prefetch",
    "prefetch_done",
    "finish_prefetch",
    "cancel_prefetch",
    "backups_in_flight",
    "host_stats",
    "check_host_invariants",
    "close",
)


def device_only() -> tuple[PageAllocator, DeviceKVPool, RadixCache]:
    allocator = PageAllocator(8, 4)
    pool = DeviceKVPool(2, allocator.num_slots, 1, 4, torch.float32, "cpu")
    return allocator, pool, RadixCache(allocator)


def hicache() -> HiRadixCache:
    allocator = PageAllocator(8, 4)
    pool = DeviceKVPool(2, allocator.num_slots, 1, 4, torch.float32, "cpu")
    host = HostKVPool(2, 64, 1, 4, torch.float32, CPU, page_size=4)
    return HiRadixCache(allocator, pool, host)


def test_a_tree_must_implement_the_tree_part() -> None:
    class Partial(PrefixTree):
        pass

    with pytest.raises(TypeError, match="abstract"):
        Partial()  # type: ignore[abstract]


def test_tier_hooks_live_in_the_base_not_in_the_device_only_tree() -> None:
    for hook in TIER_HOOKS:
        assert hook in PrefixTree.__dict__, hook
        assert hook not in RadixCache.__dict__, f"RadixCache repeats the default of {hook}"
    overridden = {hook for hook in TIER_HOOKS if hook in HiRadixCache.__dict__}
    assert {"load_back", "host_stats", "check_host_invariants", "close"} <= overridden


def test_device_only_tree_reports_zero_host_figures_under_hicache_names() -> None:
    _, _, tree = device_only()
    assert tree.storage is None and not tree.backups_in_flight
    tree.check_host_invariants()
    tree.close()
    stats = tree.host_stats()
    assert set(stats.values()) == {0}
    # The same metric names as a real host tier reports (without an L3 store).
    assert set(stats) == set(hicache().host_stats())
    stats["host_total"] = 99  # a copy: the shared default stays zero
    assert NO_HOST_STATS["host_total"] == 0


def test_kv_setup_reads_the_tree_through_the_interface() -> None:
    allocator, pool, tree = device_only()
    table = ReqTable(4, 64, torch.device("cpu"))
    kv = KVSetup(pool, table, KVCacheManager(allocator, table, tree), spec=CPU)
    assert kv.host_stats() == NO_HOST_STATS
    assert kv.host_health()["storage_backend"] is None


def test_manager_runs_the_trees_host_check() -> None:
    class BrokenHost(RadixCache):
        def check_host_invariants(self) -> None:
            raise AssertionError("host accounting broken")

    allocator = PageAllocator(8, 4)
    table = ReqTable(4, 64, torch.device("cpu"))
    manager = KVCacheManager(allocator, table, BrokenHost(allocator))
    with pytest.raises(AssertionError, match="host accounting broken"):
        manager.check_invariants([])


@pytest.mark.parametrize("relative", ["engine/kv_setup.py", "engine/kvcache/manager.py"])
def test_no_getattr_probe_of_the_tree(relative: str) -> None:
    source = (ROOT / relative).read_text()
    probes = [
        ast.unparse(node)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
        and "tree" in ast.unparse(node.args[0])
    ]
    assert probes == []
