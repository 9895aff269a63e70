"""Host tier on a real CUDA device: bytes pinned (measured), host_register and its failed
fallback, copies that land in the right order, shutdown with copies in flight."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine import host_alloc
from engine.host_alloc import alloc_host, host_alloc_method, pow2_ceil
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.host_pool import HostKVPool
from engine.kvcache.transfer import KVTransfer
from engine.platform import DeviceSpec
from tests.gpu.conftest import Figures

pytestmark = pytest.mark.cuda
SPEC = DeviceSpec("cuda", 0)
GIB = 1 << 30
SLEEP_CYCLES = 400_000_000  # a few hundred ms of GPU time: the copy is surely late


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def host_stats_reserved() -> int | None:
    """The caching host allocator's reserved bytes, where this torch reports them."""
    stats_fn = getattr(torch.cuda, "host_memory_stats", None)
    if stats_fn is None:
        return None
    stats = stats_fn()
    for key in ("reserved_bytes.current", "reserved_bytes.all.current"):
        if key in stats:
            return int(stats[key])
    return None


def measured(allocate: Callable[[], Any]) -> tuple[Any, int, int | None]:
    """(result, resident-set growth, caching-allocator growth) of ``allocate()``."""
    gc.collect()
    rss, reserved = rss_bytes(), host_stats_reserved()
    result = allocate()
    torch.cuda.synchronize()
    after = host_stats_reserved()
    grown = None if reserved is None or after is None else after - reserved
    return result, rss_bytes() - rss, grown


def test_bytes_pinned_equal_bytes_asked(figures: Figures) -> None:
    nbytes = 5 * GIB // 4 + 4096  # 1.25 GiB: pin_memory's block is 2 GiB
    shape = (nbytes // 2,)
    assert host_alloc_method("cuda:0") == "host_register"
    registered, rss_grown, _ = measured(
        lambda: alloc_host(shape, torch.float16, "cuda:0", "host_register")
    )
    assert registered.method == "host_register" and registered.pinned
    assert registered.tensor.is_pinned()
    assert registered.pinned_nbytes == nbytes
    figures.add("host_register: bytes asked", nbytes, "B")
    figures.add("host_register: resident growth (measured)", rss_grown, "B")
    # Registering faults every page in: the process grew by the bytes asked, not 2 GiB.
    assert 0.95 * nbytes <= rss_grown <= 1.05 * nbytes
    registered.release()
    del registered

    pinned, rss_grown, reserved_grown = measured(
        lambda: alloc_host(shape, torch.float16, "cuda:0", "pin_memory")
    )
    assert pinned.pinned and pinned.pinned_nbytes == pow2_ceil(nbytes) == 2 * GIB
    figures.add("pin_memory: resident growth (measured)", rss_grown, "B")
    figures.add("pin_memory: caching allocator growth", str(reserved_grown), "B")
    if reserved_grown is not None:
        # The rounding the memory check now counts for pin_memory.
        assert reserved_grown == pow2_ceil(nbytes), (
            f"the caching host allocator took {reserved_grown} B for {nbytes} B asked"
        )
    del pinned
    gc.collect()


class DoubleRegister:
    """cudart whose cudaHostRegister registers the range for real, then again: the
    second call fails (already registered) and leaves the runtime's last error set."""

    def __init__(self) -> None:
        self.real = torch.cuda.cudart()
        self.ptrs: list[int] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> Any:
        first = self.real.cudaHostRegister(ptr, nbytes, flags)
        assert int(getattr(first, "value", first)) == 0
        self.ptrs.append(ptr)
        return self.real.cudaHostRegister(ptr, nbytes, flags)

    def cudaHostUnregister(self, ptr: int) -> Any:
        return self.real.cudaHostUnregister(ptr)

    def cleanup(self) -> None:
        """Undo the first registrations; call it while their buffers are still alive."""
        torch.cuda.synchronize()
        for ptr in self.ptrs:
            rc = self.real.cudaHostUnregister(ptr)
            assert int(getattr(rc, "value", rc)) == 0
        self.ptrs.clear()


@pytest.fixture
def failing_register(monkeypatch: pytest.MonkeyPatch) -> Any:
    runtime = DoubleRegister()
    real_api = host_alloc._register_api

    def api(kind: str) -> host_alloc._RegisterApi | None:
        found = real_api(kind)
        if found is None:
            return None
        return host_alloc._RegisterApi(
            runtime, "cudaHostRegister", "cudaHostUnregister", "cudaGetLastError"
        )

    monkeypatch.setattr(host_alloc, "_register_api", api)
    return runtime


def test_failed_register_falls_back_without_a_false_error_later(failing_register: Any) -> None:
    allocation = alloc_host((1 << 20,), torch.float16, "cuda:0", "host_register")
    assert (allocation.method, allocation.pinned) == ("pageable", False)
    # Left set, the register error would be raised by this unrelated kernel's launch check.
    torch.ones(1024, device="cuda").mul_(2).sum().item()
    torch.cuda.synchronize()
    failing_register.cleanup()  # while the buffer it registered is alive
    del allocation


def make_pools(layout: str = "layer_first") -> tuple[DeviceKVPool, HostKVPool]:
    # 8 layers x 8 heads x 128 x bf16: 32 KiB per token; 4096 slots: 128 MiB each side.
    pool = DeviceKVPool(8, 4096, 8, 128, torch.bfloat16, "cuda")
    for buffer in (*pool.k_buffers, *pool.v_buffers):
        buffer.normal_()
    host = HostKVPool(8, 4096, 8, 128, torch.bfloat16, SPEC, layout=layout)
    assert host.method == "host_register" and host.pinned
    return pool, host


def kv_at(pool: DeviceKVPool, layer: int, slots: torch.Tensor) -> torch.Tensor:
    return torch.stack([pool.k_buffers[layer][slots], pool.v_buffers[layer][slots]])


def slow_down(host: HostKVPool, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Put a sleep kernel ahead of every copy ``name`` issues on its side stream."""
    real = getattr(host, name)

    def slowed(*args: Any, **kwargs: Any) -> Any:
        torch.cuda._sleep(SLEEP_CYCLES)  # on the current stream: the copy stream
        return real(*args, **kwargs)

    monkeypatch.setattr(host, name, slowed)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_load_returns_at_once_and_compute_reads_the_loaded_kv(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool, host = make_pools(layout)
    transfer = KVTransfer(pool, host, SPEC)
    assert transfer.asynchronous and transfer.non_blocking
    source = torch.randperm(2000, device="cuda")[:1024] + 1
    host_slots = host.alloc(1024)
    assert host_slots is not None
    transfer.backup_async(source, host_slots).wait()
    expected = [kv_at(pool, layer, source).clone() for layer in range(pool.num_layers)]
    targets = torch.arange(3000, 4024, device="cuda")
    for layer in range(pool.num_layers):
        pool.k_buffers[layer][targets] = 0
        pool.v_buffers[layer][targets] = 0
    torch.cuda.synchronize()

    slow_down(host, "load", monkeypatch)
    handle = transfer.load_async(host_slots, targets)
    assert not handle.done(), "load_async blocked until its copy finished"
    # Control: compute that does NOT wait reads the stale zeros (the copy really is late).
    stale = kv_at(pool, 0, targets).clone()
    reads = []
    for layer in range(pool.num_layers):
        handle.wait_layer(layer)
        reads.append(kv_at(pool, layer, targets).clone())
    torch.cuda.synchronize()
    assert not torch.equal(stale, expected[0])
    for layer in range(pool.num_layers):
        assert torch.equal(reads[layer], expected[layer]), f"layer {layer} read early"
    host.close()


def test_close_waits_for_backups_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.kvcache.allocator import PageAllocator
    from engine.kvcache.hicache import HiRadixCache

    pool, host = make_pools()
    tree = HiRadixCache(PageAllocator(4095, 1), pool, host, device=SPEC)
    slow_down(host, "backup", monkeypatch)
    handle = tree.transfer.backup_async(torch.arange(1, 513, device="cuda"), host.alloc(512))
    assert not handle.done()
    seen: list[bool] = []
    real_release = host.allocation.release

    def release() -> None:
        seen.append(handle.done_event.query())
        real_release()

    monkeypatch.setattr(host.allocation, "release", release)
    tree.close()
    torch.cuda.synchronize()
    host.close()
    assert seen == [True]
    assert host.kv_buffer.numel() == 0


def test_host_copy_bandwidth(figures: Figures) -> None:
    """Host-tier copies of scattered 16-token pages against one large contiguous copy."""
    pool = DeviceKVPool(32, 8192, 8, 128, torch.bfloat16, "cuda")  # 128 KiB per token
    host = HostKVPool(32, 4096, 8, 128, torch.bfloat16, SPEC, page_size=16)
    tokens = 2048  # 256 MiB
    pages = torch.randperm(8192 // 16 - 1)[: tokens // 16] + 1
    device_slots = (pages[:, None] * 16 + torch.arange(16)).reshape(-1).cuda()
    host_slots = host.alloc(tokens)
    assert host_slots is not None
    transfer = KVTransfer(pool, host, SPEC)
    nbytes = tokens * host.bytes_per_token

    def timed(fn: Callable[[], Any]) -> float:
        fn()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return best

    backup_s = timed(lambda: transfer.backup_async(device_slots, host_slots).wait())
    load_s = timed(lambda: transfer.load_async(host_slots, device_slots).wait())
    big_device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    big_host = host.kv_buffer.view(-1).view(torch.uint8)[:nbytes]
    d2h_s = timed(lambda: big_host.copy_(big_device, non_blocking=True))
    h2d_s = timed(lambda: big_device.copy_(big_host, non_blocking=True))
    gbs = {
        "backup (device->host, scattered pages)": nbytes / backup_s / 1e9,
        "one large copy device->host": nbytes / d2h_s / 1e9,
        "load (host->device, scattered pages)": nbytes / load_s / 1e9,
        "one large copy host->device": nbytes / h2d_s / 1e9,
    }
    for name, value in gbs.items():
        figures.add(f"host tier 256 MiB: {name}", round(value, 1), "GB/s")
    host.close()
    assert all(value > 0 for value in gbs.values())


def test_dropped_registered_buffer_is_unregistered(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine that fails half-way through construction never calls release(): the
    finalizer unregisters once the buffer is garbage, and the runtime accepts it."""
    unregistered: list[int] = []
    real_unregister = host_alloc._unregister

    def recording(api: Any, ptr: int) -> None:
        unregistered.append(ptr)
        real_unregister(api, ptr)

    monkeypatch.setattr(host_alloc, "_unregister", recording)
    allocation = alloc_host((1 << 20,), torch.float16, "cuda:0", "host_register")
    assert allocation.pinned
    ptr = allocation.tensor.data_ptr()
    with caplog.at_level("WARNING", logger="engine.host_alloc"):
        del allocation
        gc.collect()
    assert unregistered == [ptr]
    assert "failed" not in caplog.text
