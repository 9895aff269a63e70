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
from engine.kvcache.sizing import host_tier_tokens
from engine.kvcache.storage import KVNamespace, make_store, model_digest
from engine.kvcache.storage.page_seal import load_secret
from engine.kvcache.storage.tier import StorageTier
from engine.kvcache.transfer import KVTransfer, TransferFactory
from engine.model_files import default_cache_dir, gguf_file_of

logger = logging.getLogger("hiserve.hicache")


def digest_cache(config: EngineConfig) -> Path:
    """Where checkpoint digests are kept between starts (see ``keys.model_digest``)."""
    base = Path(config.cache_dir).expanduser() if config.cache_dir else default_cache_dir()
    return base / "checkpoint-digests.json"


def checkpoint_identity(config: EngineConfig, model_path: Path | None, weights_tag: str) -> str:
    """The digest of every byte the weights come from (part of the L3 namespace)."""
    if model_path is None:
        return hashlib.sha256(config.model.encode()).hexdigest()
    # Packed GGUF weights are read from the GGUF itself: it is part of the checkpoint.
    gguf = gguf_file_of(config.model) if weights_tag == "packed-gguf" else None
    return model_digest(model_path, digest_cache(config), (gguf,) if gguf is not None else ())


def build_storage(
    config: EngineConfig,
    host_pool: HostKVPool,
    model_path: Path | None,
    weights_tag: str = "dense",
) -> StorageTier | None:
    """The L3 tier named by --hicache-storage-backend, or None."""
    if config.hicache_storage_backend == "none":
        return None
    store = make_store(
        config.hicache_storage_backend,
        directory=config.hicache_storage_dir,
        max_bytes=int(config.hicache_storage_size * 1e9),
        secret=load_secret(config.hicache_storage_secret_file),
        encrypt=config.hicache_storage_encrypt,
        mooncake_master=config.hicache_mooncake_master,
        mooncake_metadata_server=config.hicache_mooncake_metadata_server,
    )
    if store is None:
        return None
    namespace = KVNamespace(
        checkpoint_identity(config, model_path, weights_tag),
        str(host_pool.dtype).removeprefix("torch."),
        host_pool.layout,
        host_pool.page_size,
        host_pool.num_layers,
        host_pool.kv_heads,
        host_pool.head_dim,
        weights=weights_tag,
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


def build_hicache(
    config: EngineConfig,
    allocator: PageAllocator,
    device_pool: DeviceKVPool,
    spec: platform.DeviceSpec,
    model_path: Path | None = None,
    make_transfer: TransferFactory = KVTransfer,
    weights_tag: str = "dense",
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
        build_storage(config, host_pool, model_path, weights_tag),
        make_transfer(device_pool, host_pool, spec),
    )
    return tree, host_pool
