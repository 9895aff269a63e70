"""Host allocation for the host tier, every branch, with fake backends on a CPU machine."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from engine import host_alloc, host_memory
from engine.config import EngineConfig
from engine.host_alloc import alloc_host, host_alloc_method, pinned_size, pow2_ceil
from engine.host_memory import HostMemoryError
from engine.kvcache.allocator import PageAllocator
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.hicache_setup import build_hicache
from engine.kvcache.host_pool import HostKVPool
from engine.kvcache.sizing import fit_pinned_tokens
from engine.platform import DeviceSpec
from tests.unit.fake_backends import (
    ExplodingCuda,
    FakeBackend,
    FakeCudart,
    install,
    pretend_pinned,
)

LOGGER = "engine.host_alloc"


def test_pow2_ceil_is_what_the_caching_allocator_pins() -> None:
    assert [pow2_ceil(n) for n in (0, 1, 2, 3, 4, 5, 1023, 1024, 1025)] == [
        1,
        1,
        2,
        4,
        4,
        8,
        1024,
        1024,
        2048,
    ]
    assert pinned_size("pin_memory", 47 * 10**9) == 64 * 2**30
    assert pinned_size("host_register", 47 * 10**9) == 47 * 10**9
    assert pinned_size("pageable", 5) == 5


# ---------------------------------------------------------------- method choice


def test_invalid_request_is_refused() -> None:
    with pytest.raises(ValueError, match="'pinned' is not valid; choose auto"):
        host_alloc_method("cpu", "pinned")


def test_unknown_method_is_refused_by_alloc_host() -> None:
    with pytest.raises(ValueError, match="unknown host allocation method 'mmap'"):
        alloc_host((2,), torch.float32, "cpu", "mmap")


@pytest.mark.parametrize("device", ["cuda:0", "musa", "npu:1", "xpu"])
def test_explicit_pageable_on_an_accelerator_is_honoured(
    device: str, fakes: dict[str, FakeBackend], empty_calls: list[dict[str, Any]]
) -> None:
    assert host_alloc_method(device, "pageable") == "pageable"
    allocation = alloc_host((4,), torch.float32, device, "pageable")
    assert empty_calls == [{"dtype": torch.float32}]
    assert (allocation.method, allocation.pinned, allocation.pinned_nbytes) == (
        "pageable",
        False,
        0,
    )


@pytest.mark.parametrize("device", ["cpu", "mps"])
def test_explicit_pin_memory_on_cpu_or_mps_is_pageable_with_a_warning(
    device: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch, "cuda", ExplodingCuda())
    with caplog.at_level(logging.WARNING, logger="engine.platform"):
        assert host_alloc_method(device, "pin_memory") == "pageable"
        assert host_alloc_method(device, "pin_memory") == "pageable"
    warnings = [r for r in caplog.records if "not supported on" in r.getMessage()]
    assert len(warnings) == 1 and device in warnings[0].getMessage()


PIN_DEVICES = ["musa", "musa:0", "MUSA:1", " npu:0 ", "xpu", "cuda", "cuda:1"]


@pytest.mark.parametrize("device", PIN_DEVICES)
def test_without_a_register_call_accelerators_pin_through_pin_memory(
    device: str,
    fakes: dict[str, FakeBackend],
    empty_calls: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pretend_pinned(monkeypatch)
    method = host_alloc_method(device)
    assert method == "pin_memory"
    allocation = alloc_host((3, 8), torch.float16, device, method)
    assert empty_calls == [{"dtype": torch.float16, "pin_memory": True}]
    assert (allocation.method, allocation.pinned) == ("pin_memory", True)
    # 48 bytes asked: the caching host allocator's block is 64.
    assert (allocation.nbytes, allocation.pinned_nbytes) == (48, 64)


def test_pinned_is_read_from_the_tensor(
    fakes: dict[str, FakeBackend],
    empty_calls: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pin_memory=True that did not pin (no error raised) is reported as not pinned."""
    pretend_pinned(monkeypatch, False)
    allocation = alloc_host((4,), torch.float16, "npu:0", "pin_memory")
    assert (allocation.method, allocation.pinned, allocation.pinned_nbytes) == (
        "pin_memory",
        False,
        0,
    )


@pytest.mark.parametrize("device", ["mps", "cpu", "CPU"])
def test_mps_and_cpu_get_pageable_memory(
    device: str, monkeypatch: pytest.MonkeyPatch, empty_calls: list[dict[str, Any]]
) -> None:
    monkeypatch.setattr(torch, "cuda", ExplodingCuda())
    method = host_alloc_method(device)
    assert method == "pageable"
    allocation = alloc_host((4, 8), torch.float32, device, method)
    assert empty_calls == [{"dtype": torch.float32}]
    assert allocation.pinned is False


def test_musa_never_touches_torch_cuda(
    monkeypatch: pytest.MonkeyPatch, empty_calls: list[dict[str, Any]]
) -> None:
    install(monkeypatch, "musa", FakeBackend())
    monkeypatch.setattr(torch, "cuda", ExplodingCuda())
    pretend_pinned(monkeypatch)
    allocation = alloc_host((2,), torch.float16, "musa:0", host_alloc_method("musa:0"))
    assert allocation.pinned and allocation.method == "pin_memory"


def test_rocm_pins_through_pin_memory_and_refuses_host_register(
    monkeypatch: pytest.MonkeyPatch, fakes: dict[str, FakeBackend], cudart: FakeCudart
) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert host_alloc_method("hip") == "pin_memory"
    assert host_alloc_method("cuda") == "pin_memory"  # cudart present, but ROCm
    with pytest.raises(ValueError, match="ROCm"):
        host_alloc_method("cuda:0", "host_register")
    with pytest.raises(ValueError, match="ROCm"):
        host_alloc_method("hip", "host_register")
    assert cudart.registered == []


@pytest.mark.parametrize("device", ["npu", "xpu", "mps", "cpu", "foo"])
def test_host_register_elsewhere_is_refused(
    device: str, monkeypatch: pytest.MonkeyPatch, fakes: dict[str, FakeBackend]
) -> None:
    monkeypatch.setattr(torch, "cuda", ExplodingCuda())
    with pytest.raises(ValueError, match="needs cudaHostRegister"):
        host_alloc_method(device, "host_register")


def test_host_register_on_a_musa_build_without_musart_is_refused(
    fakes: dict[str, FakeBackend],
) -> None:
    assert host_alloc_method("musa:0") == "pin_memory"
    with pytest.raises(ValueError, match=r"torch_musa needs >= 2\.1\.1"):
        host_alloc_method("musa:0", "host_register")


def test_unknown_backend_is_pageable_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    empty_calls: list[dict[str, Any]],
) -> None:
    monkeypatch.setattr(torch, "cuda", ExplodingCuda())
    with caplog.at_level(logging.WARNING, logger="engine.platform"):
        assert host_alloc_method("foo") == "pageable"
        assert host_alloc_method("foo:1") == "pageable"
        allocation = alloc_host((3,), torch.float32, "foo", "pageable")
    assert allocation.pinned is False and empty_calls == [{"dtype": torch.float32}]
    warnings = [r for r in caplog.records if "unknown device type 'foo'" in r.getMessage()]
    assert len(warnings) == 1


def test_unavailable_backend_is_not_pinned(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    install(monkeypatch, "musa", FakeBackend(available=False))
    with caplog.at_level(logging.WARNING, logger="engine.platform"):
        assert host_alloc_method("musa:0") == "pageable"
    assert "not available" in caplog.text


# ---------------------------------------------------------------- pin_memory failures


def test_pinning_failure_falls_back_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    install(monkeypatch, "musa", FakeBackend())
    real_empty = torch.empty

    def failing_empty(*size: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.pop("pin_memory", False):
            raise RuntimeError("out of pinnable memory")
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", failing_empty)
    with caplog.at_level(logging.WARNING, logger="engine.platform"):
        first = alloc_host((8,), torch.float16, "musa:0", host_alloc_method("musa:0"))
        second = alloc_host((8,), torch.float16, "musa:1", "pin_memory")
    assert (first.method, first.pinned) == ("pageable", False)
    assert (second.method, second.pinned) == ("pageable", False)
    assert len([r for r in caplog.records if "out of pinnable memory" in r.getMessage()]) == 1


def test_real_pin_memory_without_accelerator_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The unpatched torch.empty(pin_memory=True) of a CPU-only torch raises: fall back."""
    if torch.cuda.is_available():
        pytest.skip("this torch can pin memory")
    install(monkeypatch, "npu", FakeBackend())
    allocation = alloc_host((8,), torch.float32, "npu:0", host_alloc_method("npu:0"))
    assert (allocation.method, allocation.pinned) == ("pageable", False)
    assert not allocation.tensor.is_pinned()


# ---------------------------------------------------------------- the host pool


def pool_bytes(tokens: int) -> int:
    return DeviceKVPool.token_bytes(2, 1, 4, torch.float32) * tokens


@pytest.mark.parametrize(("register", "fits"), [(False, False), (True, True)])
def test_memory_check_counts_the_real_pinned_size(
    register: bool,
    fits: bool,
    fakes: dict[str, FakeBackend],
    empty_calls: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """100 tokens of 64 bytes: 6400 asked; pin_memory would pin 8192."""
    pretend_pinned(monkeypatch)
    if register:
        musart = FakeCudart(prefix="musa")
        fakes["musa"].musart = lambda: musart
    monkeypatch.setattr(host_memory, "available_host_memory", lambda *a, **k: 7000)
    spec = DeviceSpec("musa", 0)
    if not fits:
        with pytest.raises(HostMemoryError, match=r"needs 0\.00 GB"):
            HostKVPool(2, 100, 1, 4, torch.float32, spec)
        # 6400 bytes would fit in 7000: the 8192 really pinned does not. Refused before
        # anything was pinned.
        assert [call for call in empty_calls if "pin_memory" in call] == []
        return
    host = HostKVPool(2, 100, 1, 4, torch.float32, spec)
    assert (host.method, host.pinned, host.pinned_nbytes) == ("host_register", True, 6400)
    assert host.nbytes == pool_bytes(100)


def test_host_tier_sized_from_hicache_size() -> None:
    allocator = PageAllocator(16, 4)
    device_pool = DeviceKVPool(2, allocator.num_slots, 1, 4, torch.float32, "cpu")
    per_token = device_pool.bytes_per_token  # 64 bytes
    config = EngineConfig(enable_hierarchical_cache=True, hicache_size=1e-6)  # 1000 bytes
    tree, host = build_hicache(config, allocator, device_pool, DeviceSpec("cpu"))
    # 1000 // 64 = 15 tokens, rounded down to whole pages of 4.
    assert per_token == 64 and host.capacity == 12
    assert tree.host_pool is host
    ratio = EngineConfig(enable_hierarchical_cache=True, hicache_ratio=2.0)
    _, by_ratio = build_hicache(ratio, allocator, device_pool, DeviceSpec("cpu"))
    assert by_ratio.capacity == 2 * allocator.capacity


@pytest.mark.parametrize(
    ("tokens", "page", "method", "expected"),
    [
        (100, 4, "pageable", 100),  # exact allocations keep the request (whole pages)
        (100, 4, "host_register", 100),
        (100, 4, "pin_memory", 64),  # 6400 bytes would pin 8192: cut to the 4096 below
        (128, 4, "pin_memory", 128),  # already a power of two
        (3, 3, "pin_memory", 3),  # one page: nothing smaller exists
    ],
)
def test_pinned_tiers_pin_exactly_their_size(
    tokens: int, page: int, method: str, expected: int
) -> None:
    fitted = fit_pinned_tokens(tokens, 64, page, method)
    assert fitted == expected
    if method == "pin_memory" and fitted > page:
        assert pinned_size(method, fitted * 64) == fitted * 64  # it pins what it uses
        assert fitted <= tokens  # and no more than was asked for


def test_build_hicache_fits_a_pin_memory_tier(monkeypatch: pytest.MonkeyPatch) -> None:

    monkeypatch.setattr(host_alloc, "host_alloc_method", lambda *_: "pin_memory")
    allocator = PageAllocator(16, 4)
    device_pool = DeviceKVPool(2, allocator.num_slots, 1, 4, torch.float32, "cpu")
    config = EngineConfig(enable_hierarchical_cache=True, hicache_size=6400 / 1e9)  # 100 tokens
    _, host = build_hicache(config, allocator, device_pool, DeviceSpec("cpu"))
    assert host.capacity == 64
