"""Host allocation through cudaHostRegister / musaHostRegister: exact sizes, failures that
fall back with the runtime's error cleared, and finalizers that unregister."""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
import torch

from engine import host_alloc
from engine.host_alloc import alloc_host, host_alloc_method
from tests.unit.fake_backends import (
    ExplodingCuda,
    FakeBackend,
    FakeCudart,
    pretend_pinned,
)

LOGGER = "engine.host_alloc"


def test_cuda_registers_exactly_the_bytes_asked_by_default(
    cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    pretend_pinned(monkeypatch)
    assert host_alloc_method("cuda") == "host_register"
    assert host_alloc_method("cuda:1", "pin_memory") == "pin_memory"  # still on request
    allocation = alloc_host((3, 7), torch.float32, "cuda:0", "host_register")
    ptr, nbytes = allocation.tensor.data_ptr(), 3 * 7 * 4
    assert cudart.registered == [(ptr, nbytes, 0)]
    assert (allocation.method, allocation.pinned, allocation.pinned_nbytes) == (
        "host_register",
        True,
        nbytes,  # 84 bytes, not the 128 a power-of-two block would pin
    )
    allocation.release()
    allocation.release()  # idempotent
    assert cudart.unregistered == [ptr]
    assert (allocation.pinned, allocation.pinned_nbytes) == (False, 0)


def test_musa_registers_through_musart(
    fakes: dict[str, FakeBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    pretend_pinned(monkeypatch)
    musart = FakeCudart(prefix="musa")
    fakes["musa"].musart = lambda: musart
    monkeypatch.setattr(torch, "cuda", ExplodingCuda())
    method = host_alloc_method("musa:1")
    assert method == "host_register"
    allocation = alloc_host((5,), torch.float16, "musa:1", method)
    assert musart.registered == [(allocation.tensor.data_ptr(), 10, 0)]
    assert allocation.pinned_nbytes == 10
    allocation.release()
    assert musart.unregistered == [musart.registered[0][0]]


def test_failed_register_falls_back_and_clears_the_runtime_error(
    cudart: FakeCudart, caplog: pytest.LogCaptureFixture
) -> None:
    cudart.register_rc = 2  # cudaErrorMemoryAllocation
    with caplog.at_level(logging.WARNING, logger="engine.platform"):
        allocation = alloc_host((8,), torch.float32, "cuda", "host_register")
    assert (allocation.method, allocation.pinned, allocation.pinned_nbytes) == (
        "pageable",
        False,
        0,
    )
    assert "error code 2" in caplog.text and "memlock" in caplog.text
    # Left set, the error would surface in the next, unrelated kernel launch check.
    assert cudart.last_error == 0
    allocation.release()
    assert cudart.unregistered == []


def test_register_raising_falls_back(cudart: FakeCudart, caplog: pytest.LogCaptureFixture) -> None:
    cudart.raise_on_register = RuntimeError("driver went away")
    with caplog.at_level(logging.WARNING, logger="engine.platform"):
        allocation = alloc_host((8,), torch.float32, "cuda", "host_register")
    assert allocation.method == "pageable" and "driver went away" in caplog.text


def test_failed_unregister_is_logged_and_cleared(
    cudart: FakeCudart, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    pretend_pinned(monkeypatch)
    cudart.unregister_rc = 712  # cudaErrorHostMemoryNotRegistered
    allocation = alloc_host((8,), torch.float32, "cuda", "host_register")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        allocation.release()
    assert "cudaHostUnregister failed with error code 712" in caplog.text
    assert cudart.last_error == 0


def test_register_without_a_runtime_call_is_refused(fakes: dict[str, FakeBackend]) -> None:
    with pytest.raises(ValueError, match="host_register needs CUDA"):
        alloc_host((2,), torch.float32, "npu", "host_register")


def test_dropped_registered_buffer_is_unregistered_by_its_finalizer(
    cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine that fails half-way through construction never calls release()."""
    pretend_pinned(monkeypatch)
    allocation = alloc_host((16,), torch.float32, "cuda", "host_register")
    ptr = allocation.tensor.data_ptr()
    del allocation
    gc.collect()
    assert cudart.unregistered == [ptr]


def test_clear_last_error_without_a_getter_or_library_warns(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(host_alloc, "_loaded_runtime", lambda prefix: None)
    api = host_alloc._RegisterApi(object(), "x", "y", "musaGetLastError")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        host_alloc.clear_last_error(api)
    assert "could not clear the musa error" in caplog.text


def test_cuda_error_without_a_getter_is_cleared_by_a_launch_check(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No cudaGetLastError binding and no libcudart found: one tiny kernel's launch check
    reads (and so clears) the error; the RuntimeError it raises is the stale one."""
    launched: list[str] = []

    def ones(*args: Any, **kwargs: Any) -> torch.Tensor:
        launched.append(kwargs["device"])
        raise RuntimeError("CUDA error: part or all of the range is already mapped")

    monkeypatch.setattr(host_alloc, "_loaded_runtime", lambda prefix: None)
    monkeypatch.setattr(torch, "ones", ones)
    api = host_alloc._RegisterApi(object(), "x", "y", "cudaGetLastError")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        host_alloc.clear_last_error(api)
    assert launched == ["cuda"] and caplog.text == ""
