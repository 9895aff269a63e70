"""KV sizing arithmetic: the per-token shape of a model's KV, how many tokens the device
pool gets, and how many the host tier gets. Plain numbers in, plain numbers out; nothing
here allocates."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from engine import host_alloc, host_memory, platform
from engine.config import EngineConfig

logger = logging.getLogger("hiserve.hicache")  # the host-tier fitting message

# Without --kv-cache-tokens a CPU host gets at most this many tokens: host RAM is shared
# with everything else, and zero-filling a huge pool makes start-up slow.
CPU_DEFAULT_MAX_KV_TOKENS = 65536


class KVShape(NamedTuple):
    """The KV of one token: ``num_layers`` x (K and V) x ``kv_heads`` x ``head_dim``."""

    num_layers: int
    kv_heads: int
    head_dim: int


def kv_shape(hf_config: Any) -> KVShape:
    """The KV shape of a model config (this rank's shard of it under tensor parallelism);
    ``num_key_value_heads`` defaults to the attention heads, ``head_dim`` to hidden/heads."""
    num_heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads)
    return KVShape(int(hf_config.num_hidden_layers), kv_heads, head_dim)


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


def host_tier_tokens(
    config: EngineConfig, device_tokens: int, bytes_per_token: int, page_size: int, method: str
) -> int:
    """Host tier size in tokens: --hicache-size GB, else --hicache-ratio x the device pool,
    fitted to what the allocation ``method`` pins (``fit_pinned_tokens``)."""
    if config.hicache_size is not None:
        tokens = int(config.hicache_size * 1e9) // bytes_per_token
    else:
        tokens = int(device_tokens * config.hicache_ratio)
    return fit_pinned_tokens(tokens, bytes_per_token, page_size, method)


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
