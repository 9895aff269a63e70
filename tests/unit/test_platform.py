"""Device parsing and device-aware host allocation, with fake backends on a CPU machine."""

from __future__ import annotations

import logging
import sys
import types
from typing import Any

import pytest
import torch

from engine import platform
from engine.platform import (
    DeviceSpec,
    alloc_host,
    host_alloc_method,
    is_backend_available,
    parse_device,
    resolve_device,
)

GB = 10**9


class FakeBackend(types.SimpleNamespace):
    """Stand-in for torch.musa / torch.npu / torch.xpu / torch.cuda that records calls."""

    def __init__(self, available: bool = True, count: int = 2, **extra: Any) -> None:
        super().__init__(calls=[], **extra)
        self._available, self._count = available, count

    def is_available(self) -> bool:
        return self._available

    def device_count(self) -> int:
        return self._count

    def synchronize(self, device: Any = None) -> None:
        self.calls.append(("synchronize", device))

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        self.calls.append(("mem_get_info", device))
        return 3 * GB, 8 * GB

    def Stream(self, device: Any = None) -> str:  # mirrors torch.cuda.Stream
        self.calls.append(("Stream", device))
        return "stream"

    def Event(self) -> str:
        self.calls.append(("Event", None))
        return "event"


class ExplodingCuda:
    """A torch.cuda that fails the test on any attribute access."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"torch.cuda.{name} touched on a non-CUDA device")


class FakeCudart:
    def __init__(self, register_rc: int) -> None:
        self.register_rc = register_rc
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.registered.append((ptr, nbytes, flags))
        return self.register_rc

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


@pytest.fixture(autouse=True)
def _fresh_platform_state() -> None:
    platform._warned.clear()
    platform._import_failed.clear()


def install(monkeypatch: pytest.MonkeyPatch, name: str, backend: Any) -> Any:
    monkeypatch.setattr(torch, name, backend, raising=False)
    if name in ("musa", "npu"):
        monkeypatch.setitem(sys.modules, f"torch_{name}", types.ModuleType(f"torch_{name}"))
    return backend


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> dict[str, FakeBackend]:
    """Every accelerator backend present and available (cuda as a fake too)."""
    backends = {name: install(monkeypatch, name, FakeBackend()) for name in ("musa", "npu", "xpu")}
    backends["cuda"] = install(monkeypatch, "cuda", FakeBackend())
    return backends


@pytest.fixture
def empty_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Patch torch.empty: record each request, allocate plain memory."""
    calls: list[dict[str, Any]] = []
    real_empty = torch.empty

    def recording_empty(*size: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(dict(kwargs))
        kwargs.pop("pin_memory", None)
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", recording_empty)
    return calls


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cpu", ("cpu", None)),
        ("CPU", ("cpu", None)),
        ("cuda", ("cuda", None)),
        ("cuda:1", ("cuda", 1)),
        ("musa", ("musa", None)),
        ("musa:0", ("musa", 0)),
        ("MUSA:1", ("musa", 1)),
        ("  musa:3 ", ("musa", 3)),
        ("npu:0", ("npu", 0)),
        ("xpu", ("xpu", None)),
        ("mps", ("mps", None)),
        ("hip", ("hip", None)),
        ("auto", ("auto", None)),
        (" AUTO ", ("auto", None)),
    ],
)
def test_parse_device_strings(text: str, expected: tuple[str, int | None]) -> None:
    spec = parse_device(text)
    assert (spec.type, spec.index) == expected
    assert str(spec) == (expected[0] if expected[1] is None else f"{expected[0]}:{expected[1]}")


def test_parse_device_accepts_torch_device() -> None:
    assert parse_device(torch.device("cuda", 1)) == DeviceSpec("cuda", 1)
    assert parse_device(torch.device("cpu")) == DeviceSpec("cpu", None)


@pytest.mark.parametrize(
    "text", ["gpu", "cuda:x", "musa:", "auto:0", "", "cuda:-1", "cuda:1:2", "tpu:0"]
)
def test_parse_device_rejects_bad_strings(text: str) -> None:
    with pytest.raises(ValueError, match=r"valid forms: .*musa\[:N\]"):
        parse_device(text)


def test_musa_is_parsed_without_building_a_torch_device() -> None:
    # This torch has no MUSA backend: building torch.device("musa") raises here.
    with pytest.raises(RuntimeError):
        torch.device("musa")
    assert parse_device("musa:0") == DeviceSpec("musa", 0)


# ---------------------------------------------------------------- backend probing


def test_resolve_auto_falls_back_to_cpu_without_accelerators(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("cuda", "xpu", "mps"):
        install(monkeypatch, name, FakeBackend(available=False))
    monkeypatch.delattr(torch, "musa", raising=False)
    monkeypatch.delattr(torch, "npu", raising=False)
    monkeypatch.setitem(sys.modules, "torch_musa", None)  # import fails
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert resolve_device("auto") == DeviceSpec("cpu", None)
    with pytest.raises(RuntimeError, match="musa backend is not available"):
        resolve_device("musa:0")
    with pytest.raises(RuntimeError, match="torch_musa"):
        platform.to_torch_device(DeviceSpec("musa", 0))


def test_resolve_auto_order(monkeypatch: pytest.MonkeyPatch, fakes: dict[str, FakeBackend]) -> None:
    assert resolve_device("auto").type == "cuda"
    fakes["cuda"]._available = False
    assert resolve_device("auto").type == "musa"
    fakes["musa"]._available = False
    assert resolve_device("auto").type == "npu"


def test_resolve_explicit_device_checks_index(fakes: dict[str, FakeBackend]) -> None:
    assert resolve_device("MUSA:1") == DeviceSpec("musa", 1)
    with pytest.raises(RuntimeError, match="does not exist"):
        resolve_device("musa:2")  # the fake has 2 devices


def test_resolve_hip_needs_rocm(
    monkeypatch: pytest.MonkeyPatch, fakes: dict[str, FakeBackend]
) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(RuntimeError, match="ROCm"):
        resolve_device("hip")
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert resolve_device("hip:0") == DeviceSpec("cuda", 0)


def test_is_backend_available_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = FakeBackend()
    broken.is_available = lambda: (_ for _ in ()).throw(RuntimeError("driver gone"))  # type: ignore[method-assign]
    install(monkeypatch, "musa", broken)
    assert is_backend_available("musa") is False
    assert is_backend_available("cpu") is True
    assert is_backend_available("foo") is False


# ---------------------------------------------------------------- host allocation


PINNED_DEVICES = ["musa", "musa:0", "MUSA:1", " npu:0 ", "xpu", "cuda", "cuda:1"]
PAGEABLE_DEVICES = ["mps", "cpu", "CPU"]


@pytest.mark.parametrize("device", PINNED_DEVICES)
def test_accelerators_get_pinned_memory(
    device: str, fakes: dict[str, FakeBackend], empty_calls: list[dict[str, Any]]
) -> None:
    method = host_alloc_method(device)
    assert method == "pin_memory"
    allocation = alloc_host((4, 8), torch.float16, device, method)
    assert empty_calls == [{"dtype": torch.float16, "pin_memory": True}]
    assert (allocation.method, allocation.pinned) == ("pin_memory", True)
    assert allocation.tensor.shape == (4, 8)


@pytest.mark.parametrize("device", PAGEABLE_DEVICES)
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
    musa = install(monkeypatch, "musa", FakeBackend())
    monkeypatch.setattr(torch, "cuda", ExplodingCuda())
    allocation = alloc_host((2,), torch.float16, "musa:0", host_alloc_method("musa:0"))
    assert allocation.pinned
    spec = DeviceSpec("musa", 0)
    platform.synchronize(spec)
    assert platform.mem_get_info(spec) == (3 * GB, 8 * GB)
    assert platform.new_stream(spec) == "stream" and platform.new_event(spec) == "event"
    assert ("synchronize", 0) in musa.calls and ("Stream", 0) in musa.calls


def test_hip_gets_pin_memory_even_when_host_register_is_the_cuda_option(
    monkeypatch: pytest.MonkeyPatch, fakes: dict[str, FakeBackend]
) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert host_alloc_method("hip") == "pin_memory"
    assert host_alloc_method("cuda") == "pin_memory"
    with pytest.raises(ValueError, match="ROCm"):
        host_alloc_method("cuda:0", "host_register")


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


def test_cuda_host_register_checks_the_return_code(
    monkeypatch: pytest.MonkeyPatch, fakes: dict[str, FakeBackend]
) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    cudart = FakeCudart(register_rc=0)
    fakes["cuda"].cudart = lambda: cudart
    assert host_alloc_method("cuda") == "pin_memory"  # host_register only when asked
    method = host_alloc_method("cuda:0", "host_register")
    assert method == "host_register"
    allocation = alloc_host((16, 4), torch.float32, "cuda:0", method)
    ptr, nbytes = allocation.tensor.data_ptr(), 16 * 4 * 4
    assert cudart.registered == [(ptr, nbytes, 0)]
    assert (allocation.method, allocation.pinned) == ("host_register", True)
    allocation.release()
    allocation.release()  # idempotent
    assert cudart.unregistered == [ptr]


def test_cuda_host_register_failure_falls_back(
    monkeypatch: pytest.MonkeyPatch, fakes: dict[str, FakeBackend], caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    cudart = FakeCudart(register_rc=2)  # cudaErrorMemoryAllocation
    fakes["cuda"].cudart = lambda: cudart
    with caplog.at_level(logging.WARNING, logger="engine.platform"):
        allocation = alloc_host((8,), torch.float32, "cuda", "host_register")
    assert (allocation.method, allocation.pinned) == ("pageable", False)
    assert "error code 2" in caplog.text
    allocation.release()
    assert cudart.unregistered == []


@pytest.mark.parametrize("device", ["musa:0", "npu", "xpu", "mps", "cpu", "foo"])
def test_host_register_elsewhere_is_refused(
    device: str, monkeypatch: pytest.MonkeyPatch, fakes: dict[str, FakeBackend]
) -> None:
    monkeypatch.setattr(torch, "cuda", ExplodingCuda())
    with pytest.raises(ValueError, match="only exists on CUDA"):
        host_alloc_method(device, "host_register")


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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("requested", ["auto", "host_register"])
def test_real_cuda_pinned_allocation(requested: str) -> None:
    if requested == "host_register" and platform.is_rocm():
        pytest.skip("host_register is CUDA-only")
    method = host_alloc_method("cuda:0", requested)
    allocation = alloc_host((1024, 64), torch.float16, "cuda:0", method)
    assert allocation.pinned and allocation.tensor.is_pinned()
    src = torch.randn(1024, 64, device="cuda").half()
    allocation.tensor.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(allocation.tensor, src.cpu())
    allocation.release()


def test_cpu_helpers_are_no_ops() -> None:
    cpu = DeviceSpec("cpu")
    platform.synchronize(cpu)
    assert platform.mem_get_info(cpu) is None
    assert platform.new_stream(cpu) is None and platform.new_event(cpu) is None
    assert platform.to_torch_device(cpu) == torch.device("cpu")
