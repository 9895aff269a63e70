"""Build the KV side of the engine: device pool, allocator, request table, prefix cache."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine import host_memory, platform
from engine.config import EngineConfig
from engine.kvcache.allocator import PageAllocator
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.manager import KVCacheManager
from engine.kvcache.radix_cache import RadixCache
from engine.kvcache.req_table import ReqTable

logger = logging.getLogger("hiserve.engine")

# Without --kv-cache-tokens a CPU host gets at most this many tokens: host RAM is shared
# with everything else, and zero-filling a huge pool makes start-up slow.
CPU_DEFAULT_MAX_KV_TOKENS = 65536


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
        tree = self.manager.tree
        stats = getattr(tree, "host_stats", None)
        if stats is not None:
            return dict(stats())
        return {
            "host_total": 0,
            "host_free": 0,
            "host_cached": 0,
            "evicted_host_tokens_total": 0,
            "backup_tokens_total": 0,
            "backup_bytes_total": 0,
            "loadback_tokens_total": 0,
            "loadback_bytes_total": 0,
        }

    def host_health(self) -> dict[str, object]:
        if self.host_pool is None:
            return {
                "hicache": False,
                "host_total_tokens": 0,
                "host_alloc_method": None,
                "pinned": False,
                "storage_backend": None,
            }
        storage = getattr(self.manager.tree, "storage", None)
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
        close_tree = getattr(self.manager.tree, "close", None)
        if close_tree is not None:
            close_tree()
        if self.spec is not None:
            platform.synchronize(self.spec)
        self.host_pool.close()


def kv_pool_tokens(config: EngineConfig, spec: platform.DeviceSpec, bytes_per_token: int) -> int:
    """Device pool size in tokens: --kv-cache-tokens, or a fraction of free memory."""
    if config.kv_cache_tokens is not None:
        return config.kv_cache_tokens
    info = platform.mem_get_info(spec)
    free = info[0] if info is not None else host_memory.available_host_memory()
    tokens = int(free * config.kv_mem_fraction) // bytes_per_token
    if spec.type == "cpu":
        tokens = min(tokens, CPU_DEFAULT_MAX_KV_TOKENS)
    if tokens < 2 * config.page_size:
        raise RuntimeError(
            f"only {free / 2**30:.2f} GiB free for the KV pool; lower the model size or set "
            "--kv-cache-tokens explicitly"
        )
    return tokens


def build_kv(
    config: EngineConfig,
    hf_config: Any,
    spec: platform.DeviceSpec,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    model_path: Path | None = None,
) -> KVSetup:
    num_layers = int(hf_config.num_hidden_layers)
    num_heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads)
    per_token = DeviceKVPool.token_bytes(num_layers, kv_heads, head_dim, dtype)
    tokens = kv_pool_tokens(config, spec, per_token)
    page = config.page_size
    allocator = PageAllocator(tokens // page, page)
    device_pool = DeviceKVPool(num_layers, allocator.num_slots, kv_heads, head_dim, dtype, device)
    req_table = ReqTable(config.max_running_requests, max_model_len, device)
    host_pool = None
    tree: RadixCache
    if config.enable_hierarchical_cache and config.enable_prefix_cache:
        from engine.kvcache.hicache_setup import build_hicache

        tree, host_pool = build_hicache(config, allocator, device_pool, spec, model_path)
    else:
        tree = RadixCache(allocator, enabled=config.enable_prefix_cache)
    manager = KVCacheManager(allocator, req_table, tree)
    return KVSetup(device_pool, req_table, manager, host_pool, spec)
