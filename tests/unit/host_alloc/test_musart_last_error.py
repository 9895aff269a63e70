"""A failed musaHostRegister on torch_musa: its ``musart()`` binds no musaGetLastError, so
the sticky error is cleared in the libmusart.so the process loaded, through ctypes.

The stand-in runtime is a real shared library built here, named like torch_musa's
(``libmusart.so.5``), with a per-process last error that a failed call left set; the
process's memory map is a file that lists it, as /proc/self/maps would."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from engine import host_alloc
from engine.host_alloc import alloc_host
from tests.unit.fake_backends import ExplodingCuda, FakeBackend, FakeCudart

FAKE_MUSART = """
static int last_error = 0;
int musaGetLastError(void) { int e = last_error; last_error = 0; return e; }
int fake_set_last_error(int e) { last_error = e; return e; }
int fake_peek_last_error(void) { return last_error; }
"""


class MusartWithoutGetter(FakeCudart):
    """torch_musa's musart(): register/unregister bound, musaGetLastError not; a failed
    register sets the error in the (fake) runtime library, as the real call would."""

    def __init__(self, lib: ctypes.CDLL, register_rc: int) -> None:
        super().__init__(register_rc=register_rc, prefix="musa")
        del self.musaGetLastError
        self.lib = lib

    def _register(self, ptr: int, nbytes: int, flags: int) -> int:
        rc = super()._register(ptr, nbytes, flags)
        self.lib.fake_set_last_error(rc)
        return rc


@pytest.fixture
def libmusart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ctypes.CDLL:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the fake libmusart")
    source = tmp_path / "musart.c"
    source.write_text(FAKE_MUSART)
    lib_path = tmp_path / "musa" / "lib" / "libmusart.so.5"
    lib_path.parent.mkdir(parents=True)
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", str(lib_path), str(source)], check=True, timeout=60
    )
    maps = tmp_path / "maps"
    maps.write_text(
        "55d0c0000000-55d0c0001000 r--p 00000000 08:01 1 /usr/bin/python3.11\n"
        f"7f3a00000000-7f3a00010000 r-xp 00000000 08:01 2 {lib_path}\n"
        "7f3a00020000-7f3a00021000 rw-p 00000000 00:00 0 \n"
    )
    monkeypatch.setattr(host_alloc, "MAPS_PATH", str(maps), raising=False)
    monkeypatch.setattr(host_alloc, "_runtime_libs", {}, raising=False)
    return ctypes.CDLL(str(lib_path))


def test_failed_musa_register_clears_the_error_in_the_loaded_libmusart(
    fakes: dict[str, FakeBackend], libmusart: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch
) -> None:
    musart = MusartWithoutGetter(libmusart, register_rc=2)  # musaErrorMemoryAllocation
    fakes["musa"].musart = lambda: musart
    monkeypatch.setattr(torch, "cuda", ExplodingCuda())
    assert not hasattr(musart, "musaGetLastError")
    allocation = alloc_host((8,), torch.float32, "musa:0", "host_register")
    assert (allocation.method, allocation.pinned) == ("pageable", False)
    assert musart.registered, "the register call was never made"
    # Left set, the error would fire in the next kernel-launch check with another message.
    assert libmusart.fake_peek_last_error() == 0


def test_the_runtime_library_is_found_by_its_name_only(
    libmusart: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert host_alloc._loaded_runtime("musa") is not None
    assert host_alloc._loaded_runtime("cuda") is None  # libmusart is not libcudart
    monkeypatch.setattr(host_alloc, "MAPS_PATH", "/nonexistent/maps")
    monkeypatch.setattr(host_alloc, "_runtime_libs", {})
    assert host_alloc._loaded_runtime("musa") is None


def test_messages_name_the_torch_musa_that_added_host_register(
    fakes: dict[str, FakeBackend],
) -> None:
    """musaHostRegister is bound by torch_musa's musart() since 2.1.1, not 2.5."""
    with pytest.raises(ValueError) as refused:
        host_alloc.host_alloc_method("musa:0", "host_register")  # a musart without the call
    assert "torch_musa needs >= 2.1.1" in str(refused.value) and "2.5" not in str(refused.value)
    with pytest.raises(ValueError) as no_backend:
        host_alloc.host_alloc_method("npu:0", "host_register")
    assert "torch_musa >= 2.1.1" in str(no_backend.value)
