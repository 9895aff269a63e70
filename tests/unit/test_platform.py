"""Device parsing, backend probing and stream/event helpers, with fake backends on a CPU machine."""

from __future__ import annotations

import sys

import pytest
import torch

from engine import platform
from engine.platform import (
    DeviceSpec,
    is_backend_available,
    parse_device,
    resolve_device,
)
from tests.unit.fake_backends import FakeBackend, install


@pytest.fixture(autouse=True)
def _fresh_platform_state() -> None:
    platform._warned.clear()
    platform._import_failed.clear()


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> dict[str, FakeBackend]:
    """Every accelerator backend present and available (cuda as a fake too)."""
    backends = {name: install(monkeypatch, name, FakeBackend()) for name in ("musa", "npu", "xpu")}
    backends["cuda"] = install(monkeypatch, "cuda", FakeBackend())
    return backends


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


def test_cpu_helpers_are_no_ops() -> None:
    cpu = DeviceSpec("cpu")
    platform.synchronize(cpu)
    assert platform.mem_get_info(cpu) is None
    assert platform.new_stream(cpu) is None and platform.new_event(cpu) is None
    assert platform.to_torch_device(cpu) == torch.device("cpu")
