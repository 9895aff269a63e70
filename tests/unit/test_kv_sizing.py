"""KV sizing arithmetic (engine/kvcache/sizing.py), checked against sums written out by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig
from engine.kvcache import sizing
from engine.kvcache.device_pool import DeviceKVPool
from engine.platform import DeviceSpec

CPU = DeviceSpec("cpu", None)


def test_kv_shape_defaults_kv_heads_and_head_dim() -> None:
    grouped = SimpleNamespace(
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32
    )
    assert sizing.kv_shape(grouped) == (4, 2, 32)
    plain = SimpleNamespace(num_hidden_layers=3, num_attention_heads=4, hidden_size=64)
    assert sizing.kv_shape(plain) == (3, 4, 16)  # every head keeps KV, 64 / 4 per head


def test_kv_shape_gives_the_pool_its_bytes_per_token() -> None:
    shape = sizing.kv_shape(
        SimpleNamespace(
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8
        )
    )
    # K and V, 2 layers, 2 heads, 8 dims, 2 bytes each.
    assert DeviceKVPool.token_bytes(*shape, torch.float16) == 2 * 2 * 2 * 8 * 2


def test_explicit_kv_tokens_win() -> None:
    config = EngineConfig(model="m", kv_cache_tokens=4096)
    assert sizing.kv_pool_tokens(config, CPU, bytes_per_token=10**9) == 4096


def test_cpu_pool_is_a_fraction_of_free_memory_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sizing.host_memory, "available_host_memory", lambda: 1_000_000)
    config = EngineConfig(model="m", kv_mem_fraction=0.5)
    assert sizing.kv_pool_tokens(config, CPU, bytes_per_token=100) == 500_000 // 100
    monkeypatch.setattr(sizing.host_memory, "available_host_memory", lambda: 10**12)
    capped = sizing.kv_pool_tokens(config, CPU, bytes_per_token=100)
    assert capped == sizing.CPU_DEFAULT_MAX_KV_TOKENS


def test_too_little_memory_is_an_error_naming_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sizing.host_memory, "available_host_memory", lambda: 100)
    with pytest.raises(RuntimeError, match="--kv-cache-tokens"):
        sizing.kv_pool_tokens(EngineConfig(model="m"), CPU, bytes_per_token=100)


def test_host_tier_from_ratio_or_gigabytes() -> None:
    by_ratio = EngineConfig(model="m", hicache_ratio=2.0)
    # 2 x 1000 device tokens, cut to whole 16-token pages.
    assert sizing.host_tier_tokens(by_ratio, 1000, 64, 16, "host_register") == 2000 - 2000 % 16
    by_size = EngineConfig(model="m", hicache_size=0.001)  # 1 MB at 64 B per token
    assert sizing.host_tier_tokens(by_size, 1000, 64, 16, "host_register") == 15616


def test_pin_memory_tier_fits_the_power_of_two_below() -> None:
    # 3000 tokens x 1024 B asks 3,072,000 B; pin_memory would pin 4 MiB, so the tier is
    # cut to 2 MiB = 2048 tokens.
    assert sizing.fit_pinned_tokens(3000, 1024, 16, "pin_memory") == 2048
    assert sizing.fit_pinned_tokens(3000, 1024, 16, "host_register") == 3000 - 3000 % 16
