"""Fixtures shared by the host-allocation tests: fake accelerator backends, a fake CUDA
runtime, and a recording ``torch.empty``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine import platform
from tests.unit.fake_backends import FakeBackend, FakeCudart, install


@pytest.fixture(autouse=True)
def fresh_platform_state() -> None:
    platform._warned.clear()
    platform._import_failed.clear()


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> dict[str, FakeBackend]:
    """Every accelerator backend present and available; none has a host-register call."""
    monkeypatch.setattr(torch.version, "hip", None)
    backends = {name: install(monkeypatch, name, FakeBackend()) for name in ("musa", "npu", "xpu")}
    backends["cuda"] = install(monkeypatch, "cuda", FakeBackend())
    return backends


@pytest.fixture
def cudart(fakes: dict[str, FakeBackend]) -> FakeCudart:
    runtime = FakeCudart()
    fakes["cuda"].cudart = lambda: runtime
    return runtime


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
