"""How the other tensor-parallel ranks keep their KV equal to rank 0's: rank 0's tree copies
through ``MirroredKVTransfer`` (which records each copy), and each worker replays the
records of a step into its ``RankKV`` before that step's forward (see protocol.py).
"""

from __future__ import annotations

from typing import Any

import torch

from engine import platform
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.host_pool import HostKVPool
from engine.kvcache.req_table import ReqTable
from engine.kvcache.transfer import KVTransfer, TransferHandle
from engine.tp.protocol import KVCopy, KVGeometry, StepMessage


def _cpu(slots: torch.Tensor) -> torch.Tensor:
    return slots.detach().to("cpu", torch.int64, copy=True)


class MirroredKVTransfer(KVTransfer):
    """KVTransfer that also records each copy for the other ranks (rank 0's tree uses it)."""

    def __init__(
        self,
        device_pool: DeviceKVPool,
        host_pool: HostKVPool,
        device: platform.DeviceSpec | None,
        journal: list[KVCopy],
    ) -> None:
        super().__init__(device_pool, host_pool, device)
        self.journal = journal

    def backup_async(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> TransferHandle:
        self.journal.append(KVCopy("backup", _cpu(device_slots), _cpu(host_slots)))
        return super().backup_async(device_slots, host_slots)

    def load_async(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> TransferHandle:
        self.journal.append(KVCopy("load", _cpu(device_slots), _cpu(host_slots)))
        return super().load_async(host_slots, device_slots)


class RankKV:
    """A non-zero rank's KV: device pool, request table and host tier, no bookkeeping
    (rank 0 owns every decision about which slot holds what)."""

    def __init__(
        self,
        geometry: KVGeometry,
        hf_config: Any,
        dtype: torch.dtype,
        device: torch.device,
        spec: platform.DeviceSpec,
    ) -> None:
        num_layers = int(hf_config.num_hidden_layers)
        kv_heads = int(hf_config.num_key_value_heads)
        head_dim = int(hf_config.head_dim)
        self.spec = spec
        self.device_pool = DeviceKVPool(
            num_layers, geometry.num_slots, kv_heads, head_dim, dtype, device
        )
        self.req_table = ReqTable(geometry.max_rows, geometry.max_context, device)
        self.host_pool: HostKVPool | None = None
        self.transfer: KVTransfer | None = None
        if geometry.host_tokens:
            self.host_pool = HostKVPool(
                num_layers,
                geometry.host_tokens,
                kv_heads,
                head_dim,
                dtype,
                spec,
                layout=geometry.host_layout,
                page_size=geometry.page_size,
                alloc_method=geometry.host_alloc,
            )
            self.transfer = KVTransfer(self.device_pool, self.host_pool, spec)

    def apply(self, message: StepMessage) -> list[TransferHandle]:
        """Replay rank 0's table writes and copies; returns the loads the forward waits for."""
        for row, start, slots in message.table_writes:
            self.req_table.write(row, start, slots)
        self.req_table.flush()
        loads: list[TransferHandle] = []
        backups: list[TransferHandle] = []
        for copy in message.kv_copies:
            if self.transfer is None:
                raise RuntimeError("rank 0 sent a host-tier copy, but this rank has no host tier")
            if copy.direction == "backup":
                backups.append(self.transfer.backup_async(copy.device_slots, copy.host_slots))
            else:
                if backups:
                    # NOTE: rank 0 frees a backed-up slot only once its own copy is done;
                    # this rank's copy may still be reading it, so finish backups first.
                    self.transfer.wait_all()
                    backups = []
                handle = self.transfer.load_async(copy.host_slots, copy.device_slots)
                if not handle.finished:
                    loads.append(handle)
        if backups:
            self._order_after(backups)
        if self.transfer is not None:
            self.transfer.poll()
        return loads

    def _order_after(self, backups: list[TransferHandle]) -> None:
        """Make the compute stream wait for ``backups`` (never blocks the host): the next
        forward may overwrite slots they read."""
        stream = platform.current_stream(self.spec)
        for handle in backups:
            if stream is not None and handle.done_event is not None and not handle.finished:
                handle.done_event.wait(stream)

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.wait_all()
        if self.host_pool is not None:
            platform.synchronize(self.spec)
            self.host_pool.close()
