"""Device <-> host KV copies for HiCache.

Copy planning (runs of consecutive slots) shared with HostKVPool, and KVTransfer, which
runs HostKVPool's copies on side streams with events on GPUs and at once on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from engine.kvcache.device_pool import DeviceKVPool
from engine.platform import DeviceSpec, current_stream, new_event, new_stream, parse_device
from engine.platform import stream_context as use_stream

if TYPE_CHECKING:  # host_pool imports the copy helpers below
    from engine.kvcache.host_pool import HostKVPool

logger = logging.getLogger(__name__)
# Below this mean run length, per-run copies cost more in calls than they save.
_MIN_MEAN_RUN = 4

# ---------------------------------------------------------------- copy planning


class SlotRun(NamedTuple):
    """Positions ``offset .. offset+length-1`` of a slot list whose host slots are
    consecutive from ``host_start``; ``device_start`` >= 0 when the device slots are too."""

    offset: int
    host_start: int
    length: int
    device_start: int


def plan_runs(
    host_slots: torch.Tensor, device_slots: torch.Tensor | None, joint: bool = False
) -> list[SlotRun]:
    """Split a transfer into maximal runs of consecutive host slots (CPU int64 tensors);
    with ``joint``, also where the device slots stop being consecutive.

    Planned with numpy: a handful of torch calls here would cost more than a 1 MiB copy.
    """
    host = host_slots.numpy()
    if host.size == 0:
        return []
    breaks = np.diff(host) != 1
    if joint and device_slots is not None:
        breaks |= np.diff(device_slots.numpy()) != 1
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    ends = np.concatenate((starts[1:], [host.size]))
    if device_slots is None:
        device_first = np.full(starts.size, -1)
    else:
        device = device_slots.numpy()
        breaks_before = np.concatenate(([0], np.cumsum(np.diff(device) != 1)))  # [n]
        consecutive = breaks_before[ends - 1] == breaks_before[starts]
        device_first = np.where(consecutive, device[starts], -1)
    columns = zip(
        starts.tolist(),
        host[starts].tolist(),
        (ends - starts).tolist(),
        device_first.tolist(),
        strict=True,
    )
    return [SlotRun(*column) for column in columns]


def fragmented(runs: list[SlotRun], num_tokens: int) -> bool:
    """Too many short runs: one indexed copy beats a copy per run."""
    return len(runs) > 1 and len(runs) * _MIN_MEAN_RUN > num_tokens


def fused_kv_base(device_pool: DeviceKVPool) -> torch.Tensor | None:
    """The ``[2, L, S, H, D]`` tensor whose ``[kv, layer]`` views are the pool's buffers."""
    base = device_pool.k_buffers[0]._base
    layers = device_pool.num_layers
    if base is None or base.dim() != 5 or tuple(base.shape[:2]) != (2, layers):
        return None
    for kv, buffers in enumerate((device_pool.k_buffers, device_pool.v_buffers)):
        for layer, buffer in enumerate(buffers):
            view = base[kv, layer]
            if (buffer.data_ptr(), buffer.shape, buffer.stride()) != (
                view.data_ptr(),
                view.shape,
                view.stride(),
            ):
                return None
    return base


def copy_all(
    dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool = False
) -> None:
    """Pairwise ``dst.copy_(src)``; between CPU tensors in one dispatch, since per-call
    overhead dominates small runs (device copies are one DMA each either way)."""
    if not dsts:
        return
    if dsts[0].device.type == srcs[0].device.type == "cpu":
        torch._foreach_copy_(dsts, srcs)
        return
    for dst, src in zip(dsts, srcs, strict=True):
        dst.copy_(src, non_blocking=non_blocking)


# ---------------------------------------------------------------- asynchronous transfers


@dataclass(eq=False)
class TransferHandle:
    """One backup (device -> host) or load (host -> device) copy; ``done()`` never blocks.

    ``done_event`` is None when the copy already finished synchronously (CPU). A load also
    records ``layer_events[i]`` once layer i is on the device, so compute can wait per layer.
    """

    direction: str  # "backup" | "load"
    num_tokens: int
    num_bytes: int
    done_event: Any | None = None
    layer_events: list[Any] = field(default_factory=list)
    # NOTE: slot tensors used by the copy stream stay referenced until it is finished, so
    # the caching allocator cannot hand their memory to the compute stream too early.
    keepalive: list[torch.Tensor] = field(default_factory=list, repr=False)
    finished: bool = False

    def done(self) -> bool:
        if not self.finished and (self.done_event is None or self.done_event.query()):
            self.finished, self.keepalive = True, []
        return self.finished

    def wait(self) -> None:
        """Block the calling thread until the copy is finished."""
        if not self.finished and self.done_event is not None:
            self.done_event.synchronize()
        self.done()

    def wait_layer(self, layer: int) -> None:
        """Make the current (compute) stream wait for ``layer`` of a load; never blocks the
        host. A no-op when the copy ran synchronously."""
        if self.layer_events and not self.finished:
            self.layer_events[layer].wait()


class KVTransfer:
    """Copies between a DeviceKVPool and a HostKVPool.

    On accelerators with streams, backups and loads each run on their own stream, ordered
    after the work already queued on the compute stream, and finish asynchronously; copies
    are ``non_blocking`` only when the host pool is pinned. Elsewhere they run at once.
    """

    def __init__(
        self, device_pool: DeviceKVPool, host_pool: HostKVPool, device: DeviceSpec | None = None
    ) -> None:
        self.device_pool, self.host_pool = device_pool, host_pool
        self.spec = device if device is not None else parse_device(device_pool.device)
        self.backup_stream: Any | None = None
        self.load_stream: Any | None = None
        if self.spec.type != "cpu":
            try:
                self.backup_stream, self.load_stream = new_stream(self.spec), new_stream(self.spec)
            except Exception as exc:  # a backend without user streams: copy synchronously
                logger.warning(
                    "no copy streams on %s (%s); HiCache copies run synchronously", self.spec, exc
                )
                self.backup_stream = self.load_stream = None
        self.asynchronous = self.backup_stream is not None and self.load_stream is not None
        self.non_blocking = self.asynchronous and host_pool.pinned
        self._in_flight: list[TransferHandle] = []
        self._stats = {"backup_tokens": 0, "backup_bytes": 0, "load_tokens": 0, "load_bytes": 0}

    def backup_async(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> TransferHandle:
        """Start copying ``device_slots`` (all layers) to ``host_slots``."""
        handle = self._start("backup", device_slots, host_slots)

        def issue(_: Callable[[int], None] | None) -> None:
            self.host_pool.backup(self.device_pool, device_slots, host_slots, self.non_blocking)

        return self._issue(handle, self.backup_stream, issue)

    def load_async(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> TransferHandle:
        """Start copying ``host_slots`` back into ``device_slots``, layer by layer."""
        handle = self._start("load", device_slots, host_slots)

        def issue(on_layer: Callable[[int], None] | None) -> None:
            self.host_pool.load(
                self.device_pool, host_slots, device_slots, self.non_blocking, on_layer
            )

        return self._issue(handle, self.load_stream, issue)

    def _start(
        self, direction: str, device_slots: torch.Tensor, host_slots: torch.Tensor
    ) -> TransferHandle:
        if device_slots.numel() != host_slots.numel():
            raise ValueError(
                f"{direction}: {device_slots.numel()} device slots vs "
                f"{host_slots.numel()} host slots"
            )
        num_tokens = int(host_slots.numel())
        num_bytes = num_tokens * self.host_pool.bytes_per_token
        self._stats[f"{direction}_tokens"] += num_tokens
        self._stats[f"{direction}_bytes"] += num_bytes
        return TransferHandle(
            direction, num_tokens, num_bytes, keepalive=[device_slots, host_slots]
        )

    def _issue(
        self,
        handle: TransferHandle,
        stream: Any | None,
        issue: Callable[[Callable[[int], None] | None], None],
    ) -> TransferHandle:
        if stream is None:
            issue(None)
            handle.keepalive = []
        else:
            # NOTE: the copy stream starts after everything already queued on the compute
            # stream: a backup reads KV that compute wrote, a load overwrites slots whose
            # previous readers were queued there.
            compute = current_stream(self.spec)
            if compute is not None:
                stream.wait_stream(compute)

            def record_event() -> Any:
                event: Any = new_event(self.spec)
                event.record(stream)
                return event

            def record_layer(_: int) -> None:
                handle.layer_events.append(record_event())

            with use_stream(self.spec, stream):
                issue(record_layer if handle.direction == "load" else None)
                handle.done_event = record_event()
        self._in_flight.append(handle)
        return handle

    def poll(self) -> list[TransferHandle]:
        """Handles that finished since the last poll (checked without blocking)."""
        finished = [h for h in self._in_flight if h.done()]
        if finished:
            self._in_flight = [h for h in self._in_flight if not h.finished]
        return finished

    def wait_all(self) -> list[TransferHandle]:
        """Block until every copy is finished; returns those not yet reported by poll."""
        for handle in self._in_flight:
            handle.wait()
        return self.poll()

    @property
    def num_in_flight(self) -> int:
        return sum(not h.finished for h in self._in_flight)

    def stats(self) -> dict[str, int]:
        """Tokens and bytes issued per direction since creation."""
        return dict(self._stats)
