"""Asynchronous device <-> host KV copies for HiCache.

KVTransfer runs HostKVPool's copies (engine/kvcache/host_copy.py) on side streams with
events on GPUs, and at once on CPU; TransferHandle tracks one of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.kvcache.device_pool import DeviceKVPool
from engine.platform import DeviceSpec, current_stream, new_event, new_stream, parse_device
from engine.platform import stream_context as use_stream

if TYPE_CHECKING:
    from engine.kvcache.host_pool import HostKVPool

logger = logging.getLogger(__name__)

# Builds a tree's copier between the tiers (tensor parallel: one that records each copy).
TransferFactory = Callable[[DeviceKVPool, "HostKVPool", DeviceSpec | None], "KVTransfer"]


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
    # The engine's device: compute waits on ITS current stream, whatever device the
    # calling thread has current (an event's wait() alone means the current device's).
    device: DeviceSpec | None = None
    done_event: Any | None = None
    layer_events: list[Any] = field(default_factory=list)
    # NOTE: slot tensors used by the copy stream stay referenced until it is finished, so
    # the caching allocator cannot hand their memory to the compute stream too early.
    keepalive: list[torch.Tensor] = field(default_factory=list, repr=False)
    # Host-side work that may run only once the copy is done (fragmented backups).
    finishers: list[Callable[[], None]] = field(default_factory=list, repr=False)
    finished: bool = False

    def done(self) -> bool:
        if not self.finished and (self.done_event is None or self.done_event.query()):
            for finish in self.finishers:
                finish()
            self.finished, self.keepalive, self.finishers = True, [], []
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
            assert self.device is not None
            self.layer_events[layer].wait(current_stream(self.device))


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
            handle.finishers = self.host_pool.backup(
                self.device_pool, device_slots, host_slots, self.non_blocking
            )

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
            direction, num_tokens, num_bytes, self.spec, keepalive=[device_slots, host_slots]
        )

    def _issue(
        self,
        handle: TransferHandle,
        stream: Any | None,
        issue: Callable[[Callable[[int], None] | None], None],
    ) -> TransferHandle:
        if stream is None:
            issue(None)
            handle.done()  # copied synchronously: finish now
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
