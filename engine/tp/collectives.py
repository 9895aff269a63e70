"""Collectives for tensor parallelism: which process-group backend a device uses, which
devices the ranks get, and starting the group.

NOTE: the backend is chosen by the bare device type, never the raw string (``musa:0``
uses the ``musa`` entry), the same rule as host allocation in engine/platform.py.
The sharded layers are in engine/layers/parallel_linear.py and engine/models/tp_shard.py,
the rank processes in engine/tp/runtime.py (rank 0) and engine/tp/worker.py.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.platform import DeviceSpec, ensure_backend_imported, parse_device

logger = logging.getLogger(__name__)

# Bare device type -> torch.distributed backend. ROCm's torch names RCCL "nccl".
COLLECTIVE_BACKENDS = {
    "cuda": "nccl",
    "hip": "nccl",
    "musa": "mccl",  # registered by torch_musa
    "npu": "hccl",  # registered by torch_npu
    "xpu": "xccl",
    "cpu": "gloo",
}
# Out-of-tree backends register themselves when their device package is imported.
_PROVIDED_BY = {"mccl": "torch_musa", "hccl": "torch_npu"}
# Leaving the group happens on the monitor thread (a worker died) and on the thread that
# stops the runtime, possibly at once: one at a time.
_LEAVE_LOCK = threading.Lock()


def collective_backend(device: str | torch.device | DeviceSpec) -> str:
    """The process-group backend for ``device`` (``"musa:0"`` -> ``"mccl"``)."""
    spec = parse_device(device)
    if spec.type == "auto":
        raise ValueError("resolve the 'auto' device before choosing a collective backend")
    backend = COLLECTIVE_BACKENDS.get(spec.type)
    if backend is None:
        raise ValueError(
            f"tensor parallelism is not available on device type {spec.type!r}: torch has no "
            f"collective backend for it. Supported: "
            f"{', '.join(f'{k} ({v})' for k, v in COLLECTIVE_BACKENDS.items())}; "
            "use --tensor-parallel-size 1 there"
        )
    return backend


def check_collective_backend(
    device: str | torch.device | DeviceSpec,
    is_available: Callable[[str], bool] = dist.is_backend_available,
    import_device_backend: Callable[[str], None] = ensure_backend_imported,
) -> str:
    """``collective_backend(device)``, after checking this torch build can run it."""
    spec = parse_device(device)
    backend = collective_backend(spec)
    import_device_backend(spec.type)  # torch_musa / torch_npu register mccl / hccl
    if not is_available(backend):
        package = _PROVIDED_BY.get(backend)
        hint = f" (it comes with {package})" if package else ""
        raise RuntimeError(
            f"collective backend {backend!r} for device {str(device)!r} is not available in "
            f"this torch build{hint}; install a build with {backend}, or use "
            "--tensor-parallel-size 1"
        )
    return backend


def rank_devices(
    device: str | torch.device | DeviceSpec,
    tp_size: int,
    device_ids: Sequence[int] | None = None,
    visible: int | None = None,
) -> list[DeviceSpec]:
    """The device of each rank: ``musa:0`` with ``tp_size=2`` -> ``musa:0``, ``musa:1``
    (``musa:2`` -> 2, 3); ``device_ids`` gives the list explicitly. On the CPU every rank
    is ``cpu``. ``visible``: how many devices of the type exist (checked when given)."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    spec = parse_device(device)
    if spec.type == "auto":
        raise ValueError("resolve the 'auto' device before placing tensor-parallel ranks")
    if spec.type == "cpu":
        return [spec] * tp_size
    if device_ids is None:
        first = spec.index or 0
        ids = list(range(first, first + tp_size))
    else:
        ids = list(device_ids)
        if len(ids) != tp_size:
            raise ValueError(
                f"{len(ids)} device ids given ({ids}) for tensor_parallel_size={tp_size}"
            )
        if len(set(ids)) != len(ids):
            raise ValueError(f"device ids {ids} repeat a device; each rank needs its own")
    if visible is not None and max(ids) >= visible:
        raise ValueError(
            f"tensor_parallel_size={tp_size} on {spec} needs {spec.type} devices {ids}, but "
            f"only {visible} are visible; lower --tensor-parallel-size or pick other devices"
        )
    return [DeviceSpec(spec.type, i) for i in ids]


def init_process_group(
    device: str | torch.device | DeviceSpec,
    rank: int,
    world_size: int,
    init_method: str | None = None,
    timeout_s: float = 600.0,
    store: dist.Store | None = None,
) -> str:
    """Join the tensor-parallel group as ``rank`` with the device's backend (rendezvous
    through ``init_method``, or an already open ``store``); returns the backend."""
    backend = check_collective_backend(device)
    where = init_method if store is None else type(store).__name__
    logger.info("rank %d/%d joins the %s group through %s", rank, world_size, backend, where)
    dist.init_process_group(
        backend=backend,
        init_method=init_method if store is None else None,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return backend


def abort_collectives() -> bool:
    """Abort every process group of this process without waiting for its peers: a
    collective blocked on a dead rank (NCCL and MCCL wait for their timeout) then returns
    with an error. True if an abort ran; best effort, never collective.

    NOTE: ``destroy_process_group()`` is collective on NCCL (it may wait for the peers'
    teardown), so a group with a dead or stranded rank is aborted, never destroyed.
    """
    with _LEAVE_LOCK:
        if not dist.is_initialized():
            return False
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # torch >= 2.3
        if abort is None:
            logger.warning("this torch build cannot abort a process group; leaving it as is")
            return False
        abort()
        return True


def leave_group(backend: str) -> None:
    """Leave every process group of this process without waiting for the peers: gloo's
    destroy is local; elsewhere destroy may be collective, so the group is aborted."""
    if backend != "gloo":
        abort_collectives()
        return
    with _LEAVE_LOCK:
        if dist.is_initialized():
            dist.destroy_process_group()
