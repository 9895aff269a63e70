"""Stand-ins for accelerator backends (torch.musa, torch.cuda, cudart) on a CPU machine."""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

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

    def set_device(self, device: Any) -> None:
        self.calls.append(("set_device", device))


class ExplodingCuda:
    """A torch.cuda that fails the test on any attribute access."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"torch.cuda.{name} touched on a non-CUDA device")


class FakeCudart:
    """cudart (or musart, with ``prefix="musa"``) that records register calls and keeps
    a per-thread "last error" like the real runtime: a failed call leaves it set until
    the get-last-error call reads and clears it."""

    def __init__(self, register_rc: int = 0, unregister_rc: int = 0, prefix: str = "cuda") -> None:
        self.register_rc, self.unregister_rc = register_rc, unregister_rc
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []
        self.last_error = 0
        self.raise_on_register: Exception | None = None
        setattr(self, f"{prefix}HostRegister", self._register)
        setattr(self, f"{prefix}HostUnregister", self._unregister)
        setattr(self, f"{prefix}GetLastError", self._get_last_error)

    def _register(self, ptr: int, nbytes: int, flags: int) -> int:
        if self.raise_on_register is not None:
            raise self.raise_on_register
        self.registered.append((ptr, nbytes, flags))
        self.last_error = self.register_rc or self.last_error
        return self.register_rc

    def _unregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        self.last_error = self.unregister_rc or self.last_error
        return self.unregister_rc

    def _get_last_error(self) -> int:
        error, self.last_error = self.last_error, 0
        return error


def install(monkeypatch: pytest.MonkeyPatch, name: str, backend: Any) -> Any:
    monkeypatch.setattr(torch, name, backend, raising=False)
    if name in ("musa", "npu"):
        monkeypatch.setitem(sys.modules, f"torch_{name}", types.ModuleType(f"torch_{name}"))
    return backend


def pretend_pinned(monkeypatch: pytest.MonkeyPatch, pinned: bool = True) -> None:
    """Make ``Tensor.is_pinned()`` answer ``pinned`` (a CPU-only torch always says no)."""
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a, **k: pinned)


# ---------------------------------------------------------------- streams and events


class FakeStream:
    def __init__(self, name: str, log: list[tuple[Any, ...]], device: int = 0) -> None:
        self.name, self.log, self.device = name, log, device

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))


class FakeEvent:
    """Completes only when told to (``complete = True``) or synchronised."""

    def __init__(self, backend: FakeStreamBackend) -> None:
        self.backend, self.log = backend, backend.log
        self.complete, self.stream = False, ""

    def record(self, stream: FakeStream) -> None:
        self.stream = stream.name
        self.log.append(("record", stream.name))

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.log.append(("event_synchronize", self.stream))
        self.complete = True

    def wait(self, stream: FakeStream | None = None) -> None:
        # Like torch.cuda.Event.wait: no stream means the CURRENT device's current stream.
        target = stream if stream is not None else self.backend.current_stream()
        self.log.append(("wait_event", self.stream, target.name))


class FakeStreamBackend(types.SimpleNamespace):
    """torch.musa stand-in with a current device per thread (0 until set), one compute
    stream per device ("compute0", "compute1", ...), side streams, and events that
    complete when told to."""

    def __init__(self) -> None:
        log: list[tuple[Any, ...]] = []
        super().__init__(log=log, events=[], streams=0)
        self._local = threading.local()
        self.computes: dict[int, FakeStream] = {}
        self.active: dict[int, FakeStream] = {}

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 2

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, device: int) -> None:
        self.log.append(("set_device", device, threading.current_thread().name))
        self._local.device = device

    def synchronize(self, device: Any = None) -> None:
        self.log.append(("synchronize", device))

    def Stream(self, device: Any = None) -> FakeStream:
        self.streams += 1
        return FakeStream(f"side{self.streams}", self.log, device or 0)

    def Event(self) -> FakeEvent:
        self.events.append(FakeEvent(self))
        return self.events[-1]

    def current_stream(self, device: Any = None) -> FakeStream:
        index = self.current_device() if device is None else device
        if index not in self.active:
            self.computes[index] = FakeStream(f"compute{index}", self.log, index)
            self.active[index] = self.computes[index]
        return self.active[index]

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        self.current_stream(stream.device)
        previous, self.active[stream.device] = self.active[stream.device], stream
        try:
            yield
        finally:
            self.active[stream.device] = previous


def install_fake_streams(monkeypatch: pytest.MonkeyPatch) -> FakeStreamBackend:
    """Install a FakeStreamBackend as torch.musa (torch_musa counts as imported)."""
    from engine import platform

    backend = FakeStreamBackend()
    monkeypatch.setattr(torch, "musa", backend, raising=False)
    monkeypatch.setitem(sys.modules, "torch_musa", types.ModuleType("torch_musa"))
    platform._import_failed.clear()
    return backend


class UnbuildableKernel:
    """A Triton kernel the device's Triton cannot build (a backend never tried there):
    every launch raises; launches are counted."""

    ERROR = "PassManager::run failed"

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches += 1
            raise RuntimeError(self.ERROR)

        return launch
