"""Build the KV side of the engine: device pool, allocator, request table, prefix cache."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine import platform
from engine.config import EngineConfig
from engine.kvcache.allocator import PageAllocator
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.manager import KVCacheManager
from engine.kvcache.radix_cache import RadixCache
from engine.kvcache.req_table import ReqTable, TableJournal
from engine.kvcache.sizing import kv_pool_tokens, kv_shape
from engine.kvcache.transfer import KVTransfer, TransferFactory


@dataclass
class KVSetup:
    """The KV objects of one engine and the host tier when HiCache is on."""

    device_pool: DeviceKVPool
    req_table: ReqTable
    manager: KVCacheManager
    host_pool: Any = None  # HostKVPool when HiCache is on
    spec: platform.DeviceSpec | None = None

    def flush(self) -> bool:
        return self.manager.tree.clear()

    def host_stats(self) -> dict[str, float]:
        return self.manager.tree.host_stats()

    def host_health(self) -> dict[str, object]:
        if self.host_pool is None:
            return {
                "hicache": False,
                "host_total_tokens": 0,
                "host_alloc_method": None,
                "pinned": False,
                "storage_backend": None,
            }
        storage = self.manager.tree.storage
        return {
            "hicache": True,
            "host_total_tokens": self.host_pool.capacity,
            "host_alloc_method": self.host_pool.method,
            "pinned": self.host_pool.pinned,
            "host_pinned_bytes": self.host_pool.pinned_nbytes,
            "storage_backend": storage.store.name if storage is not None else None,
        }

    def close(self) -> None:
        """Release the host tier once nothing can touch it any more: copies on the side
        streams finished, the device idle (the loop thread must have stopped)."""
        if self.host_pool is None:
            return
        self.manager.tree.close()
        if self.spec is not None:
            platform.synchronize(self.spec)
        self.host_pool.close()


def build_kv(
    config: EngineConfig,
    hf_config: Any,
    spec: platform.DeviceSpec,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    model_path: Path | None = None,
    table_journal: TableJournal | None = None,
    make_transfer: TransferFactory = KVTransfer,
    weights_tag: str = "dense",
) -> KVSetup:
    """The KV side of one engine. Tensor parallel (rank 0) passes ``table_journal`` and
    ``make_transfer`` so that the other ranks can mirror every table write and copy.
    ``weights_tag`` names the weight format (dense, packed GGUF, bf16 weights): KV
    computed from another format is another L3 namespace."""
    shape = kv_shape(hf_config)
    per_token = DeviceKVPool.token_bytes(*shape, dtype)
    tokens = kv_pool_tokens(config, spec, per_token)
    page = config.page_size
    allocator = PageAllocator(tokens // page, page)
    device_pool = DeviceKVPool(
        shape.num_layers, allocator.num_slots, shape.kv_heads, shape.head_dim, dtype, device
    )
    req_table = ReqTable(config.max_running_requests, max_model_len, device, table_journal)
    host_pool = None
    tree: RadixCache
    if config.enable_hierarchical_cache and config.enable_prefix_cache:
        from engine.kvcache.hicache_setup import build_hicache  # L3 stores load on demand

        tree, host_pool = build_hicache(
            config, allocator, device_pool, spec, model_path, make_transfer, weights_tag
        )
    else:
        tree = RadixCache(allocator, enabled=config.enable_prefix_cache)
    manager = KVCacheManager(allocator, req_table, tree)
    return KVSetup(device_pool, req_table, manager, host_pool, spec)
