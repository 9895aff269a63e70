"""Device abstraction: device strings, backend modules, streams and events.

Every device-specific call in the engine goes through here, dispatched by the bare
device type ("musa" for "musa:0"), so that MUSA, NPU and XPU never see a CUDA-only call.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)

ACCELERATOR_TYPES = ("cuda", "hip", "musa", "npu", "xpu", "mps")
DEVICE_TYPES = ("cpu", *ACCELERATOR_TYPES)
# `auto` probes these in order; ROCm reports itself as "cuda".
AUTO_ORDER = ("cuda", "musa", "npu", "xpu", "mps")
VALID_DEVICE_FORMS = "auto, cpu, cuda[:N], hip[:N], musa[:N], npu[:N], xpu[:N], mps (any case)"
# Out-of-tree backends: torch.<type> exists only once their package is imported.
_BACKEND_PACKAGES = {"musa": "torch_musa", "npu": "torch_npu"}

_warned: set[str] = set()
_import_failed: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed device string: lower-case type ("musa", "cpu", "auto") and optional index."""

    type: str
    index: int | None = None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    @property
    def is_accelerator(self) -> bool:
        return self.type in ACCELERATOR_TYPES


def _bare_type(device: str | torch.device | DeviceSpec) -> str:
    """Device type without index, lower-cased; accepts types this module does not know."""
    if isinstance(device, (DeviceSpec, torch.device)):
        return device.type
    return device.strip().lower().split(":", 1)[0]


def parse_device(device: str | torch.device | DeviceSpec) -> DeviceSpec:
    """Parse a device string as text; never builds a torch.device (torch rejects "musa"
    until torch_musa is imported)."""
    if isinstance(device, DeviceSpec):
        return device
    if isinstance(device, torch.device):
        text = str(device)
    elif isinstance(device, str):
        text = device
    else:
        raise ValueError(f"invalid device {device!r}; valid forms: {VALID_DEVICE_FORMS}")
    name, sep, index_text = text.strip().lower().partition(":")
    valid_type = name == "auto" or name in DEVICE_TYPES
    valid_index = not sep or (index_text.isdigit() and name != "auto")
    if not (valid_type and valid_index):
        raise ValueError(f"invalid device {device!r}; valid forms: {VALID_DEVICE_FORMS}")
    if name == "cpu" or not sep:
        return DeviceSpec(name, None)
    return DeviceSpec(name, int(index_text))


def is_rocm() -> bool:
    return getattr(torch.version, "hip", None) is not None


def ensure_backend_imported(device_type: str) -> None:
    """Import the out-of-tree package (torch_musa, torch_npu) that registers the backend."""
    kind = _bare_type(device_type)
    package = _BACKEND_PACKAGES.get(kind)
    if package is None or hasattr(torch, kind):
        return
    try:
        importlib.import_module(package)
    except Exception as exc:  # ImportError, or a driver/runtime error raised at import
        raise RuntimeError(
            f"device type {kind!r} needs the {package} package, which cannot be imported "
            f"({exc}); install it (it ships in the vendor's PyTorch image) or use --device cpu"
        ) from exc


def backend_module(device_type: str) -> ModuleType | None:
    """torch.cuda / torch.musa / torch.npu / torch.xpu / torch.mps, or None (cpu, unknown)."""
    kind = _bare_type(device_type)
    name = "cuda" if kind == "hip" else kind
    if name not in ("cuda", "musa", "npu", "xpu", "mps"):
        return None
    if name in _BACKEND_PACKAGES and name not in _import_failed:
        try:
            ensure_backend_imported(name)
        except RuntimeError:
            _import_failed.add(name)  # probing again would rescan sys.path every call
    return getattr(torch, name, None)


def is_backend_available(device_type: str) -> bool:
    """Whether the backend is installed and sees a device; never raises."""
    try:
        kind = _bare_type(device_type)
        if kind == "cpu":
            return True
        if kind == "hip" and not is_rocm():
            return False
        module = backend_module(kind)
        if module is None:
            return False
        return bool(module.is_available())
    except Exception:  # a broken driver must not crash device probing
        return False


def _device_count(kind: str) -> int | None:
    module = backend_module(kind)
    try:
        return int(module.device_count()) if module is not None else None
    except Exception:
        return None


def resolve_device(device: str | torch.device | DeviceSpec) -> DeviceSpec:
    """Parse ``device``, pick a backend for ``auto``, and check that it is usable."""
    spec = parse_device(device)
    if spec.type == "auto":
        for kind in AUTO_ORDER:
            if is_backend_available(kind):
                return DeviceSpec(kind, None)
        return DeviceSpec("cpu", None)
    if spec.type == "cpu":
        return spec
    if spec.type == "hip":
        if not is_rocm():
            raise RuntimeError(
                f"device {device!r} needs a ROCm build of torch (torch.version.hip is None); "
                "use --device cuda on NVIDIA, or --device auto"
            )
        spec = DeviceSpec("cuda", spec.index)  # ROCm torch calls its devices "cuda"
    if not is_backend_available(spec.type):
        hint = {
            "musa": " (is torch_musa installed and MUSA_VISIBLE_DEVICES set?)",
            "npu": " (is torch_npu installed?)",
        }.get(spec.type, "")
        raise RuntimeError(
            f"device {str(device)!r} was requested but the {spec.type} backend is not "
            f"available{hint}; use --device auto to pick what is present, or --device cpu"
        )
    count = _device_count(spec.type)
    if spec.index is not None and count is not None and spec.index >= count:
        raise RuntimeError(
            f"device {spec} does not exist: {count} {spec.type} device(s) are visible"
        )
    return spec


def to_torch_device(spec: DeviceSpec) -> torch.device:
    """The torch.device for a resolved spec (imports torch_musa/torch_npu first)."""
    if spec.type == "auto":
        raise ValueError("resolve_device() the 'auto' device before building a torch.device")
    ensure_backend_imported(spec.type)
    kind = "cuda" if spec.type == "hip" else spec.type
    return torch.device(kind) if spec.index is None else torch.device(kind, spec.index)


# ---------------------------------------------------------------- streams and events
# These pass the device index (None: the current device), never a torch.device, so they
# work before and regardless of how the backend registers its device type with torch.


def set_device(spec: DeviceSpec) -> None:
    """Make ``spec`` the calling thread's current device. Calls that take no device (an
    event's ``wait()``, ``current_stream()``) then mean this one, not device 0."""
    module = backend_module(spec.type)
    if module is None or spec.index is None or spec.type == "mps":
        return
    setter = getattr(module, "set_device", None)
    if setter is not None:
        setter(spec.index)


def synchronize(spec: DeviceSpec) -> None:
    module = backend_module(spec.type)
    if module is None:
        return
    if spec.type == "mps":
        module.synchronize()
    else:
        module.synchronize(spec.index)


def mem_get_info(spec: DeviceSpec) -> tuple[int, int] | None:
    """(free, total) device memory in bytes; None on CPU or when the backend cannot say."""
    module = backend_module(spec.type)
    if module is None:
        return None
    if spec.type == "mps":
        total = int(module.recommended_max_memory())
        return total - int(module.current_allocated_memory()), total
    if not hasattr(module, "mem_get_info"):
        return None
    free, total = module.mem_get_info(spec.index)
    return int(free), int(total)


def new_stream(spec: DeviceSpec) -> Any | None:
    """A new side stream on ``spec``; None where there are no user streams (cpu, mps)."""
    module = backend_module(spec.type)
    if module is None or spec.type == "mps" or not hasattr(module, "Stream"):
        return None
    return module.Stream(device=spec.index)


def new_event(spec: DeviceSpec) -> Any | None:
    module = backend_module(spec.type)
    if module is None or not hasattr(module, "Event"):
        return None
    return module.Event()


def current_stream(spec: DeviceSpec) -> Any | None:
    module = backend_module(spec.type)
    if module is None or spec.type == "mps":
        return None
    return module.current_stream(spec.index)


def stream_context(spec: DeviceSpec, stream: Any | None) -> Any:
    """Context manager that makes ``stream`` current (a no-op for None)."""
    module = backend_module(spec.type)
    if module is None or stream is None:
        return contextlib.nullcontext()
    return module.stream(stream)


# ---------------------------------------------------------------- device graphs


@dataclass(frozen=True)
class GraphApi:
    """A backend's graph capture API: torch.cuda's CUDAGraph / graph / graph_pool_handle,
    or torch_musa's MUSAGraph / graph / graph_pool_handle (the same shape)."""

    module: ModuleType
    graph_cls: Any  # () -> a graph object with .replay()
    capture: Any  # context manager: capture(graph, pool=..., ...)
    pool_handle: Any  # () -> a memory pool id that several captures share


GRAPH_DEVICE_TYPES = ("cuda", "musa")


def graph_api(device: str | torch.device | DeviceSpec) -> GraphApi | None:
    """The graph API of ``device``'s backend, resolved by its bare type (``MUSAGraph`` on
    musa, never a torch.cuda call there); None where there is no such API (cpu, mps,
    npu, xpu, or a backend build without it)."""
    kind = _bare_type(device)
    kind = "cuda" if kind == "hip" else kind
    if kind not in GRAPH_DEVICE_TYPES:
        return None
    module = backend_module(kind)
    if module is None:
        return None
    graph_cls = getattr(module, f"{kind.upper()}Graph", None)
    capture = getattr(module, "graph", None)
    pool_handle = getattr(module, "graph_pool_handle", None)
    if graph_cls is None or capture is None or pool_handle is None:
        return None
    return GraphApi(module, graph_cls, capture, pool_handle)
