"""Host allocation for the HiCache host tier: pinned where the backend can pin, with the
bytes pinned equal to the bytes asked for where the backend has a host-register call.

``torch.empty(..., pin_memory=True)`` goes through the caching host allocator (CUDA's and
torch_musa's), which rounds every block up to a power of two: 47 GB asked pins 64 GiB.
So on CUDA (and on torch_musa >= 2.1.1, whose ``musart()`` has ``musaHostRegister``) the
tier is pageable memory registered with the backend (``host_register``): exactly the bytes
asked for.
Backends without such a call pin through ``pin_memory``, and the memory check counts the
rounded size, which is what they really pin.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.platform import (
    DeviceSpec,
    _bare_type,
    _warn_once,
    backend_module,
    is_backend_available,
    is_rocm,
)

logger = logging.getLogger(__name__)

HOST_ALLOC_METHODS = ("pin_memory", "host_register", "pageable")
# The first torch_musa whose musart() binds musaHostRegister / musaHostUnregister (its
# csrc/core/musart.cpp); detection is by attribute, this is only for messages.
MUSA_HOST_REGISTER_SINCE = "2.1.1"
# NOTE: keyed by the bare device type, never the raw string: "musa:0" and "MUSA:1" both
# use the "musa" entry. Types missing here get pageable memory and a warning. cuda and
# musa get host_register instead where the backend has the call (see _register_api).
_HOST_ALLOC_BY_TYPE = {
    "cuda": "pin_memory",
    "hip": "pin_memory",  # host-register maps a different device address on ROCm
    "musa": "pin_memory",
    "npu": "pin_memory",
    "xpu": "pin_memory",
    "mps": "pageable",
    "cpu": "pageable",
}


def pow2_ceil(nbytes: int) -> int:
    """The block the caching host allocator really pins for ``nbytes``."""
    return 1 if nbytes <= 1 else 1 << (nbytes - 1).bit_length()


@dataclass(frozen=True)
class _RegisterApi:
    """A backend's host-register calls (cudart / musart), by name."""

    runtime: Any
    register: str
    unregister: str
    get_last_error: str

    def rc(self, result: Any) -> int:
        """The runtime's error enum (pybind) or a plain int; 0 is success."""
        return int(getattr(result, "value", result))


def _register_api(kind: str) -> _RegisterApi | None:
    """cudaHostRegister on CUDA (not ROCm), musaHostRegister on torch_musa builds that
    expose it (>= 2.1.1); None elsewhere."""
    if kind == "cuda" and not is_rocm():
        cudart = getattr(backend_module("cuda"), "cudart", None)
        runtime = cudart() if callable(cudart) else None
        names = ("cudaHostRegister", "cudaHostUnregister", "cudaGetLastError")
    elif kind == "musa":
        musart = getattr(backend_module("musa"), "musart", None)
        runtime = musart() if callable(musart) else None
        names = ("musaHostRegister", "musaHostUnregister", "musaGetLastError")
    else:
        return None
    if runtime is None or not hasattr(runtime, names[0]) or not hasattr(runtime, names[1]):
        return None
    return _RegisterApi(runtime, *names)


def host_alloc_method(device: str | torch.device | DeviceSpec, requested: str = "auto") -> str:
    """How the host tier is allocated for ``device``: host_register, pin_memory or pageable.

    ``auto`` registers pageable memory where the backend can (exact size), else pins
    through ``pin_memory``; an explicit ``host_register`` where the backend has no such
    call raises ValueError rather than silently changing what the operator asked for.
    """
    if requested not in ("auto", *HOST_ALLOC_METHODS):
        raise ValueError(
            f"host allocation {requested!r} is not valid; choose auto, "
            + ", ".join(HOST_ALLOC_METHODS)
        )
    kind = _bare_type(device)
    if requested == "pageable":
        return "pageable"
    if requested == "host_register" and kind not in ("cuda", "musa"):
        backend = "ROCm" if kind == "hip" else kind
        raise ValueError(
            f"--hicache-host-alloc host_register needs cudaHostRegister (CUDA) or "
            f"musaHostRegister (torch_musa >= {MUSA_HOST_REGISTER_SINCE}), but the device is {str(device)!r} "
            f"({backend}); use --hicache-host-alloc auto or pageable"
        )
    default = _HOST_ALLOC_BY_TYPE.get(kind)
    if default is None:
        _warn_once(
            f"unknown:{kind}",
            f"unknown device type {kind!r}: the host KV tier uses "
            "pageable memory (no pinning, slower host<->device copies)",
        )
        return "pageable"
    if default == "pageable":
        if requested != "auto":
            _warn_once(
                f"nopin:{kind}",
                f"pinned host memory is not supported on {kind}; "
                "the host KV tier uses pageable memory",
            )
        return "pageable"
    if not is_backend_available(kind):
        _warn_once(
            f"unavailable:{kind}",
            f"the {kind} backend is not available, so host "
            "memory cannot be pinned; the host KV tier uses pageable memory",
        )
        return "pageable"
    has_register = _register_api(kind) is not None
    if requested == "host_register" and not has_register:
        backend = "ROCm" if is_rocm() else kind
        raise ValueError(
            f"--hicache-host-alloc host_register: this {backend} build has no host-register "
            "call (ROCm maps registered memory elsewhere; torch_musa needs >= "
            f"{MUSA_HOST_REGISTER_SINCE}); use "
            "--hicache-host-alloc auto or pageable"
        )
    if requested == "pin_memory":
        return "pin_memory"
    return "host_register" if has_register else "pin_memory"


def pinned_size(method: str, nbytes: int) -> int:
    """Host bytes that allocating ``nbytes`` with ``method`` really takes (the memory check
    counts this): pin_memory rounds up to a power of two, the others are exact."""
    return pow2_ceil(nbytes) if method == "pin_memory" else nbytes


def _tensor_is_pinned(tensor: torch.Tensor) -> bool:
    """Ask the tensor itself (the backend's pointer attributes), never assume."""
    try:
        return bool(tensor.is_pinned())
    except Exception:  # a backend that cannot answer has not pinned it for us
        return False


# Where the dynamic loader lists the libraries this process has mapped.
MAPS_PATH = "/proc/self/maps"
_runtime_libs: dict[str, Any] = {}


def _loaded_runtime(prefix: str) -> Any:
    """The ``lib<prefix>rt.so*`` this process already loaded (torch's libcudart,
    torch_musa's libmusart), opened with ctypes; None if it is not mapped."""
    if prefix not in _runtime_libs:
        try:
            with open(MAPS_PATH) as maps:
                paths = sorted(
                    {line.split()[-1] for line in maps if f"lib{prefix}rt.so" in line.split()[-1]}
                )
        except OSError:
            return None
        if not paths:
            return None
        try:
            _runtime_libs[prefix] = ctypes.CDLL(paths[0])
        except OSError:
            return None
    return _runtime_libs[prefix]


def clear_last_error(api: _RegisterApi) -> None:
    """Reset the runtime's per-thread last error after a failed call: left set, it would
    surface as a false error in the next, unrelated kernel launch check.

    NOTE: torch_musa's ``musart()`` binds musaHostRegister/-Unregister but no
    musaGetLastError (nor does every torch's ``cudart()`` bind cudaGetLastError), so the
    getter is called in the runtime library the process already loaded, through ctypes.
    """
    getter = getattr(api.runtime, api.get_last_error, None)
    if getter is not None:
        getter()
        return
    prefix = api.get_last_error.removesuffix("GetLastError")
    lib = _loaded_runtime(prefix)
    if lib is not None and hasattr(lib, api.get_last_error):
        getattr(lib, api.get_last_error)()
        return
    if prefix == "cuda":
        # A kernel launch check reads the pending error, and reading clears it.
        with contextlib.suppress(RuntimeError):
            torch.ones(1, device="cuda")
        return
    logger.warning(
        "could not clear the %s error left by a failed host register (no lib%srt.so "
        "loaded); a later kernel may report it",
        prefix,
        prefix,
    )


def _unregister(api: _RegisterApi, ptr: int) -> None:
    try:
        rc = api.rc(getattr(api.runtime, api.unregister)(ptr))
    except Exception as exc:  # at interpreter exit the runtime may be gone already
        logger.warning("%s failed: %s", api.unregister, exc)
        return
    if rc != 0:
        clear_last_error(api)
        logger.warning("%s failed with error code %d", api.unregister, rc)


@dataclass
class HostAllocation:
    """A host buffer plus how it was obtained; ``release()`` unregisters host-registered
    memory (also done by a finalizer when the buffer is dropped without release)."""

    tensor: torch.Tensor
    method: str
    pinned: bool
    # Host bytes this allocation really holds pinned (0 when pageable).
    pinned_nbytes: int = 0
    _finalizer: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def release(self) -> None:
        """Unregister host-registered memory; idempotent, a no-op for other methods."""
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer()
        self.pinned, self.pinned_nbytes = False, 0


def _pageable(size: tuple[int, ...], dtype: torch.dtype) -> HostAllocation:
    return HostAllocation(torch.empty(size, dtype=dtype), "pageable", False)


def _register(kind: str, size: tuple[int, ...], dtype: torch.dtype) -> HostAllocation:
    api = _register_api(kind)
    if api is None:
        raise ValueError(
            f"host_register needs CUDA or torch_musa >= {MUSA_HOST_REGISTER_SINCE}; "
            f"device type is {kind!r}"
        )
    tensor = torch.empty(size, dtype=dtype)
    nbytes = tensor.numel() * tensor.element_size()
    ptr = tensor.data_ptr()
    try:
        rc = api.rc(getattr(api.runtime, api.register)(ptr, nbytes, 0))
        reason = f"error code {rc}"
    except Exception as exc:
        rc, reason = -1, str(exc)
    if rc != 0:
        clear_last_error(api)
        _warn_once(
            "register_failed",
            f"{api.register} of {nbytes / 1e9:.2f} GB failed ({reason}); using pageable "
            "memory (pinned: false). Check the memlock limit (ulimit -l / ulimits: memlock: -1)",
        )
        return HostAllocation(tensor, "pageable", False)
    # NOTE: the finalizer holds the pointer, not the tensor: an engine that fails half-way
    # through its construction still unregisters once the buffer is dropped.
    finalizer = weakref.finalize(tensor, _unregister, api, ptr)
    pinned = _tensor_is_pinned(tensor)
    return HostAllocation(tensor, "host_register", pinned, nbytes if pinned else 0, finalizer)


def alloc_host(
    shape: Sequence[int],
    dtype: torch.dtype,
    device: str | torch.device | DeviceSpec,
    method: str,
) -> HostAllocation:
    """Allocate a host tensor with ``method``; pinning failures fall back to pageable."""
    kind = _bare_type(device)
    size = tuple(shape)
    if method == "pageable":
        return _pageable(size, dtype)
    if method == "host_register":
        return _register(kind, size, dtype)
    if method == "pin_memory":
        # NOTE: pin_memory=True pins for the current accelerator (torch >= 2.3 asks the
        # CUDA, XPU or PrivateUse1 hooks; torch_musa and torch_npu are PrivateUse1).
        try:
            tensor = torch.empty(size, dtype=dtype, pin_memory=True)
        except Exception as exc:
            _warn_once(
                "pin_failed",
                f"pinning the host KV tier on {kind} failed ({exc}); "
                "using pageable memory (pinned: false)",
            )
            return _pageable(size, dtype)
        pinned = _tensor_is_pinned(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        return HostAllocation(tensor, "pin_memory", pinned, pinned_size(method, nbytes) * pinned)
    raise ValueError(f"unknown host allocation method {method!r}; one of {HOST_ALLOC_METHODS}")


def staging_empty(
    shape: Sequence[int] | int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A host buffer a step's inputs are gathered in before one copy to ``device``:
    pinned (``pinned_empty``) for an accelerator, so the copy does not wait for the
    queued work; plain memory for the CPU, where the copy is a move."""
    if device.type != "cpu":
        return pinned_empty(shape, dtype)
    return torch.empty((shape,) if isinstance(shape, int) else tuple(shape), dtype=dtype)


def pinned_empty(shape: Sequence[int] | int, dtype: torch.dtype) -> torch.Tensor:
    """A small host buffer for one asynchronous upload or download, from the backend's
    caching host allocator, which keeps it from reuse until the copies recorded on it
    ran; pageable (the copy is then synchronous) where nothing can pin."""
    size = (shape,) if isinstance(shape, int) else tuple(shape)
    try:
        return torch.empty(size, dtype=dtype, pin_memory=True)
    except Exception:  # RuntimeError on a CPU-only torch
        return torch.empty(size, dtype=dtype)
