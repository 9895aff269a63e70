"""KVTransfer: synchronous copies on CPU, stream/event orchestration with a fake backend."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.host_pool import HostKVPool
from engine.kvcache.transfer import KVTransfer
from engine.platform import DeviceSpec
from tests.unit.fake_backends import FakeStreamBackend

LAYERS, HEADS, DIM = 4, 2, 8


def make_pools(
    device: str = "cpu", layout: str = "layer_first", pinned_device: DeviceSpec | None = None
) -> tuple[DeviceKVPool, HostKVPool]:
    device_pool = DeviceKVPool(LAYERS, 64, HEADS, DIM, torch.float16, device)
    for buffer in (*device_pool.k_buffers, *device_pool.v_buffers):
        buffer.copy_(torch.randn(buffer.shape).half())
    host = HostKVPool(
        LAYERS, 64, HEADS, DIM, torch.float16, pinned_device or DeviceSpec("cpu"), layout=layout
    )
    return device_pool, host


def kv_of(pool: DeviceKVPool, slots: torch.Tensor) -> torch.Tensor:
    """[2, L, n, H, D] copy of the KV at ``slots`` (read by plain indexing)."""
    return torch.stack(
        [
            torch.stack([b[slots].cpu() for b in buffers])
            for buffers in (pool.k_buffers, pool.v_buffers)
        ]
    )


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_cpu_copies_finish_at_once_and_are_polled_once(layout: str) -> None:
    device_pool, host = make_pools(layout=layout)
    transfer = KVTransfer(device_pool, host)
    assert not transfer.asynchronous and not transfer.non_blocking
    host_slots = host.alloc(10)
    assert host_slots is not None
    source = torch.arange(3, 13)
    expected = kv_of(device_pool, source)

    backup = transfer.backup_async(source, host_slots)
    assert backup.done() and backup.done_event is None
    assert transfer.poll() == [backup] and transfer.poll() == []

    targets = torch.arange(40, 50)
    load = transfer.load_async(host_slots, targets)
    load.wait()
    load.wait_layer(LAYERS - 1)  # no-op on CPU
    assert transfer.wait_all() == [load]
    assert torch.equal(kv_of(device_pool, targets), expected)

    token_bytes = 2 * LAYERS * HEADS * DIM * 2  # K and V, fp16
    assert transfer.stats() == {
        "backup_tokens": 10,
        "backup_bytes": 10 * token_bytes,
        "load_tokens": 10,
        "load_bytes": 10 * token_bytes,
    }


def test_mismatched_slot_counts_are_refused() -> None:
    device_pool, host = make_pools()
    transfer = KVTransfer(device_pool, host)
    with pytest.raises(ValueError, match="2 device slots vs 3 host slots"):
        transfer.backup_async(torch.arange(1, 3), torch.arange(3))
    assert transfer.stats()["backup_tokens"] == 0


# ---------------------------------------------------------------- fake streams


@pytest.mark.parametrize(("pinned", "index"), [(True, 0), (False, 0), (True, 1)])
def test_gpu_copies_run_on_side_streams_with_events(
    fake_musa: FakeStreamBackend, monkeypatch: pytest.MonkeyPatch, pinned: bool, index: int
) -> None:
    device_pool, host = make_pools()
    host.allocation.pinned = pinned  # what alloc_host would report for pinned memory
    issued: list[tuple[str, str, bool]] = []
    real_backup, real_load = host.backup, host.load
    compute = f"compute{index}"

    def backup(*args: Any) -> Any:
        issued.append(("backup", fake_musa.current_stream(index).name, args[-1]))
        return real_backup(*args)

    def load(*args: Any) -> None:
        issued.append(("load", fake_musa.current_stream(index).name, args[-2]))
        real_load(*args)

    monkeypatch.setattr(host, "backup", backup)
    monkeypatch.setattr(host, "load", load)
    transfer = KVTransfer(device_pool, host, DeviceSpec("musa", index))
    assert transfer.asynchronous and transfer.non_blocking is pinned

    host_slots = host.alloc(6)
    assert host_slots is not None
    source = torch.arange(1, 7)
    expected = kv_of(device_pool, source)
    backup_handle = transfer.backup_async(source, host_slots)
    assert issued == [("backup", "side1", pinned)]
    assert fake_musa.log[:2] == [("wait_stream", "side1", compute), ("record", "side1")]
    assert fake_musa.current_stream(index).name == compute  # the stream context was left
    assert not backup_handle.done() and transfer.poll() == []
    assert backup_handle.keepalive  # slots stay referenced while in flight

    targets = torch.arange(20, 26)
    load_handle = transfer.load_async(host_slots, targets)
    assert issued[-1] == ("load", "side2", pinned)
    assert [e.stream for e in load_handle.layer_events] == ["side2"] * LAYERS
    assert load_handle.done_event is not None and load_handle.done_event.stream == "side2"
    # The calling thread's current device stays 0: the wait must still land on the
    # engine device's compute stream, or attention on musa:1 reads KV before it lands.
    assert fake_musa.current_device() == 0
    load_handle.wait_layer(2)
    assert fake_musa.log[-1] == ("wait_event", "side2", compute)

    assert backup_handle.done_event is not None
    backup_handle.done_event.complete = True
    assert transfer.poll() == [backup_handle] and transfer.poll() == []
    assert backup_handle.keepalive == []
    assert transfer.num_in_flight == 1
    assert transfer.wait_all() == [load_handle] and load_handle.done()
    # The fake "device" pool lives on the CPU, so the data really moved.
    assert torch.equal(kv_of(device_pool, targets), expected)
