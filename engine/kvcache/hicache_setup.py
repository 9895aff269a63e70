"""Size and build the HiCache host tier (L2) and the L3 store below it."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from engine import host_alloc, platform
from engine.config import EngineConfig
from engine.kvcache.allocator import PageAllocator
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.hicache import HiRadixCache
from engine.kvcache.host_pool import HostKVPool
from engine.kvcache.storage import KVNamespace, make_store, model_digest
from engine.kvcache.storage.tier import StorageTier

logger = logging.getLogger("hiserve.hicache")


def build_storage(
    config: EngineConfig, host_pool: HostKVPool, model_path: Path | None
) -> StorageTier | None:
    """The L3 tier named by --hicache-storage-backend, or None."""
    store = make_store(
        config.hicache_storage_backend,
        directory=config.hicache_storage_dir,
        max_bytes=int((config.hicache_storage_size or 0) * 1e9),
        mooncake_master=config.hicache_mooncake_master,
        mooncake_metadata_server=config.hicache_mooncake_metadata_server,
    )
    if store is None:
        return None
    identity = (
        model_digest(model_path)
        if model_path is not None
        else hashlib.sha256(config.model.encode()).hexdigest()
    )
    namespace = KVNamespace(
        identity,
        str(host_pool.dtype).removeprefix("torch."),
        host_pool.layout,
        host_pool.page_size,
        host_pool.num_layers,
        host_pool.kv_heads,
        host_pool.head_dim,
    )
    logger.info(
        "HiCache L3: %s store, prefetch %s (threshold %d tokens), namespace %s",
        store.name,
        config.hicache_storage_prefetch_policy,
        config.hicache_storage_prefetch_threshold,
        namespace.digest()[:12],
    )
    return StorageTier(
        store,
        namespace.digest(),
        host_pool,
        config.hicache_write_policy,
        config.hicache_storage_prefetch_policy,
        config.hicache_storage_prefetch_threshold,
    )


def fit_pinned_tokens(tokens: int, bytes_per_token: int, page_size: int, method: str) -> int:
    """Host-tier tokens, in whole pages, such that the bytes pinned equal the tier's bytes.

    NOTE: ``pin_memory`` goes through the caching host allocator, which pins the next
    power of two (47 GB asked pins 64 GiB). Where the backend cannot register pageable
    memory instead (ROCm, NPU, XPU, torch_musa < 2.1.1), the tier is cut down to the largest
    whole-page size whose bytes fit the power of two below the request, so it pins no
    more than the operator gave it.
    """
    tokens = max(tokens - tokens % page_size, page_size)
    if method != "pin_memory":
        return tokens
    block = host_alloc.pow2_ceil(tokens * bytes_per_token)
    if block != tokens * bytes_per_token:
        block //= 2  # the largest power of two below the request
    fitted = block // bytes_per_token
    fitted -= fitted % page_size
    if fitted < page_size:
        return tokens  # a single page: nothing smaller exists
    if fitted != tokens:
        logger.info(
            "HiCache host tier: %d tokens instead of %d, so that the %d bytes pinned through "
            "pin_memory (a power of two) are all the tier's; --hicache-host-alloc "
            "host_register avoids the rounding where the backend has it",
            fitted,
            tokens,
            fitted * bytes_per_token,
        )
    return fitted


def host_tier_tokens(
    config: EngineConfig, device_tokens: int, bytes_per_token: int, page_size: int, method: str
) -> int:
    """Host-tier tokens of one rank: --hicache-size GB, else --hicache-ratio x its device
    pool, in whole pages that pin no more than asked (see fit_pinned_tokens)."""
    if config.hicache_size is not None:
        tokens = int(config.hicache_size * 1e9) // bytes_per_token
    else:
        tokens = int(device_tokens * config.hicache_ratio)
    return fit_pinned_tokens(tokens, bytes_per_token, page_size, method)


def build_hicache(
    config: EngineConfig,
    allocator: PageAllocator,
    device_pool: DeviceKVPool,
    spec: platform.DeviceSpec,
    model_path: Path | None = None,
) -> tuple[HiRadixCache, HostKVPool]:
    """Size the host tier (--hicache-size GB, else --hicache-ratio x device pool)."""
    per_token = device_pool.bytes_per_token
    host_tokens = host_tier_tokens(
        config,
        allocator.capacity,
        per_token,
        allocator.page_size,
        host_alloc.host_alloc_method(spec, config.hicache_host_alloc),
    )
    host_pool = HostKVPool(
        device_pool.num_layers,
        host_tokens,
        device_pool.kv_heads,
        device_pool.head_dim,
        device_pool.dtype,
        spec,
        layout=config.hicache_mem_layout,
        page_size=allocator.page_size,
        alloc_method=config.hicache_host_alloc,
    )
    logger.info(
        "HiCache host tier: %d tokens (%.2f GB), layout %s, write policy %s, "
        "allocation %s, pinned %s",
        host_tokens,
        host_tokens * per_token / 1e9,
        config.hicache_mem_layout,
        config.hicache_write_policy,
        host_pool.method,
        host_pool.pinned,
    )
    tree = HiRadixCache(
        allocator,
        device_pool,
        host_pool,
        config.hicache_write_policy,
        config.hicache_load_threshold,
        spec,
        build_storage(config, host_pool, model_path),
    )
    return tree, host_pool
