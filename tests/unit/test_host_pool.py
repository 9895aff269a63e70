"""HostKVPool: slot accounting and device <-> host copies against direct indexing."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import host_memory, platform
from engine.host_memory import HostMemoryError
from engine.kvcache import host_copy
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.host_pool import HostKVPool
from engine.platform import DeviceSpec
from tests.unit.fake_backends import pretend_pinned

CPU = DeviceSpec("cpu")
LAYERS, HEADS, DIM = 3, 2, 4


def make_pools(
    layout: str,
    page_size: int,
    device_slots: int = 64,
    host_tokens: int = 96,
    dtype: torch.dtype = torch.float32,
) -> tuple[DeviceKVPool, HostKVPool]:
    device_pool = DeviceKVPool(LAYERS, device_slots, HEADS, DIM, dtype, "cpu")
    generator = torch.Generator().manual_seed(0)
    for buffer in (*device_pool.k_buffers, *device_pool.v_buffers):
        buffer.copy_(torch.randn(buffer.shape, generator=generator).to(dtype))
    host = HostKVPool(
        LAYERS, host_tokens, HEADS, DIM, dtype, CPU, layout=layout, page_size=page_size
    )
    host.kv_buffer.fill_(-7.0)  # fresh host memory is uninitialized (may hold NaN)
    return device_pool, host


def host_kv(host: HostKVPool, kv: int, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """Read host slots straight from the documented buffer layout."""
    if host.layout == "layer_first":  # [2, L, N, H, D]
        return host.kv_buffer[kv, layer, slots]
    return host.kv_buffer[kv, slots, layer]  # [2, N, L, H, D]


def device_kv(pool: DeviceKVPool, kv: int, layer: int, slots: torch.Tensor) -> torch.Tensor:
    return (pool.k_buffers if kv == 0 else pool.v_buffers)[layer][slots]


def fragmented_host_slots(host: HostKVPool, num_tokens: int) -> torch.Tensor:
    """Host slots that are not one run: allocate everything, free every other page."""
    everything = host.alloc(host.available)
    assert everything is not None
    pages = everything.view(-1, host.page_size)
    host.free(pages[1::2].reshape(-1))
    host.free(pages[0::2].reshape(-1))  # pushed last: handed out first, every other page
    slots = host.alloc(num_tokens)
    assert slots is not None
    return slots[:num_tokens]


SLOT_PATTERNS = ["contiguous", "scattered_device", "device_pages", "fragmented_host"]


def slots_for(
    pattern: str, host: HostKVPool, device_pool: DeviceKVPool, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    if pattern == "contiguous":
        device_slots = torch.arange(5, 5 + n)
        host_slots = host.alloc(n)
        assert host_slots is not None
        return device_slots, host_slots[:n]
    if pattern == "device_pages":  # runs of 4 consecutive device slots in random order
        pages = torch.randperm((device_pool.num_slots - 1) // 4, generator=generator)[: n // 4]
        device_slots = (pages[:, None] * 4 + torch.arange(4) + 1).reshape(-1)
    else:
        device_slots = torch.randperm(device_pool.num_slots - 1, generator=generator)[:n] + 1
    if pattern in ("scattered_device", "device_pages"):
        host_slots = host.alloc(n)
        assert host_slots is not None
        return device_slots, host_slots[:n]
    return device_slots, fragmented_host_slots(host, n)


@pytest.mark.parametrize("piece_bytes", [None, 1], ids=["one_piece", "token_pieces"])
@pytest.mark.parametrize(
    "staged", ["direct", "staged", "staged_run_dmas"], ids=["direct", "staged", "run_dmas"]
)
@pytest.mark.parametrize("pattern", SLOT_PATTERNS)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_round_trip(
    layout: str,
    page_size: int,
    pattern: str,
    staged: str,
    piece_bytes: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if staged == "staged_run_dmas":  # no run is too small: a DMA per run, never a gather
        monkeypatch.setattr(host_copy, "MIN_RUN_BYTES", 0)
    if piece_bytes is not None:  # CPU copies one token per piece; staging one page per chunk
        monkeypatch.setattr(host_copy, "CPU_PIECE_BYTES", piece_bytes)
        monkeypatch.setattr(host_copy, "STAGE_BYTES", piece_bytes)
    device_pool, host = make_pools(layout, page_size)
    host._force_staged = staged != "direct"
    n = 24
    device_slots, host_slots = slots_for(pattern, host, device_pool, n)
    host_before = host.kv_buffer.clone()
    host.backup(device_pool, device_slots, host_slots)
    for kv in range(2):
        for layer in range(LAYERS):
            assert torch.equal(
                host_kv(host, kv, layer, host_slots),
                device_kv(device_pool, kv, layer, device_slots),
            )
    untouched = torch.ones(host.capacity, dtype=torch.bool)
    untouched[host_slots] = False
    slot_dim = 2 if layout == "layer_first" else 1
    assert torch.equal(
        host.kv_buffer.index_select(slot_dim, untouched.nonzero().flatten()),
        host_before.index_select(slot_dim, untouched.nonzero().flatten()),
    )

    # Load into other device slots (the reverse order breaks every run) and compare.
    expected = {
        (kv, layer): device_kv(device_pool, kv, layer, device_slots).clone()
        for kv in range(2)
        for layer in range(LAYERS)
    }
    targets = torch.arange(device_pool.num_slots - n, device_pool.num_slots).flip(0)
    keep = torch.arange(1, 5)  # never a target: must keep its values
    kept = {
        (kv, layer): device_kv(device_pool, kv, layer, keep).clone()
        for kv in range(2)
        for layer in range(LAYERS)
    }
    seen: list[int] = []
    host.load(device_pool, host_slots, targets, on_layer=seen.append)
    assert seen == list(range(LAYERS))
    for (kv, layer), values in expected.items():
        assert torch.equal(device_kv(device_pool, kv, layer, targets), values)
        assert torch.equal(device_kv(device_pool, kv, layer, keep), kept[(kv, layer)])


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_fragmented_pinned_backup_scatters_once_the_copy_is_done(layout: str) -> None:
    """Pinned memory: the fragmented backup queues one DMA and hands back the CPU
    scatter, which must wait for the copy stream; nothing blocks the host meanwhile."""
    device_pool, host = make_pools(layout, page_size=1)
    host._force_staged = True
    device_slots = torch.arange(1, 25)
    host_slots = fragmented_host_slots(host, 24)
    finishers = host.backup(device_pool, device_slots, host_slots, non_blocking=True)
    assert len(finishers) == 1
    assert bool((host_kv(host, 0, 0, host_slots) == -7.0).all())  # not scattered yet
    finishers[0]()
    for kv in range(2):
        for layer in range(LAYERS):
            assert torch.equal(
                host_kv(host, kv, layer, host_slots),
                device_kv(device_pool, kv, layer, device_slots),
            )


def test_run_threshold_is_a_byte_size() -> None:
    runs = host_copy.plan_runs(torch.tensor([0, 1, 2, 3, 10, 11, 12, 13]))
    assert len(runs) == 2
    # Two runs of 4 tokens: 8 tokens x 8 KiB = 64 KiB, 32 KiB a run: too small.
    assert host_copy.fragmented(runs, 8, 8 << 10)
    # At 16 KiB a token each run is 64 KiB: one DMA per run.
    assert not host_copy.fragmented(runs, 8, 16 << 10)
    assert not host_copy.fragmented(runs[:1], 4, 1)  # one run is never fragmented


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("staged", [False, True])
def test_load_layer_moves_one_layer_only(layout: str, staged: bool) -> None:
    device_pool, host = make_pools(layout, page_size=2)
    host._force_staged = staged
    host_slots = host.alloc(10)
    assert host_slots is not None
    device_slots = torch.arange(1, 11)
    host.backup(device_pool, device_slots, host_slots)
    targets = torch.arange(30, 40)
    before = [device_kv(device_pool, 0, layer, targets).clone() for layer in range(LAYERS)]
    host.load_layer(device_pool, host_slots, targets, layer=1)
    assert torch.equal(
        device_kv(device_pool, 0, 1, targets), device_kv(device_pool, 0, 1, device_slots)
    )
    assert torch.equal(
        device_kv(device_pool, 1, 1, targets), device_kv(device_pool, 1, 1, device_slots)
    )
    for layer in (0, 2):
        assert torch.equal(device_kv(device_pool, 0, layer, targets), before[layer])


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_copies_are_bit_exact(layout: str, dtype: torch.dtype, staged: bool) -> None:
    """Every bit pattern survives a round trip, NaN payloads and infinities included (CPU
    loads move rows as wider elements; that must never be an arithmetic copy)."""
    device_pool, host = make_pools(layout, page_size=1, dtype=dtype)
    host._force_staged = staged
    bits = device_pool.kv_buffer.view(torch.uint8)
    bits.copy_(torch.randint(0, 256, bits.shape, dtype=torch.uint8))
    nan_like = device_pool.kv_buffer.view(-1)[:64]
    nan_like.view(torch.uint8).fill_(0xFF)  # all-ones: NaN with a full payload
    device_slots = torch.randperm(device_pool.num_slots - 1)[:20] + 1
    host_slots = fragmented_host_slots(host, 20)
    original = device_pool.kv_buffer.clone()
    host.backup(device_pool, device_slots, host_slots)
    targets = torch.arange(device_pool.num_slots - 20, device_pool.num_slots)
    device_pool.kv_buffer[:, :, targets] = 0
    host.load(device_pool, host_slots, targets)
    raw = device_pool.kv_buffer.view(torch.uint8)
    want = original.view(torch.uint8)
    assert torch.equal(raw[:, :, targets], want[:, :, device_slots])


def test_empty_and_mismatched_copies() -> None:
    device_pool, host = make_pools("layer_first", 1)
    empty = torch.empty(0, dtype=torch.int64)
    host.backup(device_pool, empty, empty)
    seen: list[int] = []
    host.load(device_pool, empty, empty, on_layer=seen.append)
    assert seen == list(range(LAYERS))
    with pytest.raises(ValueError, match="one of each"):
        host.backup(device_pool, torch.arange(1, 4), torch.arange(2))
    other = DeviceKVPool(LAYERS, 8, HEADS, DIM, torch.float16, "cpu")
    with pytest.raises(ValueError, match="geometry"):
        host.load(other, torch.arange(2), torch.arange(1, 3))


# ---------------------------------------------------------------- accounting


def test_alloc_rounds_up_to_pages_and_refuses_when_full() -> None:
    _, host = make_pools("layer_first", page_size=4, host_tokens=18)
    assert host.capacity == 16 and host.available == 16  # 18 tokens hold 4 whole pages
    slots = host.alloc(5)
    assert slots is not None and slots.dtype == torch.int64 and slots.numel() == 8
    assert host.available == 8
    assert host.alloc(9) is None and host.available == 8
    host.free(slots)
    assert host.available == 16


def test_free_rejects_double_free_and_partial_pages() -> None:
    _, host = make_pools("layer_first", page_size=4)
    slots = host.alloc(8)
    assert slots is not None
    with pytest.raises(ValueError, match="whole pages"):
        host.free(slots[:3])
    with pytest.raises(ValueError, match="whole pages"):
        host.free(slots[1:5])
    host.free(slots[:4])
    with pytest.raises(ValueError, match="freed twice"):
        host.free(slots[:4])
    assert host.available == host.capacity - 4


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 3, 4]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 30), st.integers(0, 10**6)), max_size=40),
)
def test_free_list_never_overlaps_or_loses_slots(
    page_size: int, ops: list[tuple[bool, int, int]]
) -> None:
    host = HostKVPool(1, 60, 1, 2, torch.float32, CPU, page_size=page_size)
    owned: list[torch.Tensor] = []
    for is_alloc, size, pick in ops:
        if is_alloc or not owned:
            free_before = host.available
            slots = host.alloc(size)
            pages_needed = -(-size // page_size)
            if pages_needed * page_size > free_before:
                assert slots is None and host.available == free_before
                continue
            assert slots is not None and slots.numel() == pages_needed * page_size
            assert host.available == free_before - slots.numel()
            owned.append(slots)
        else:
            host.free(owned.pop(pick % len(owned)))
        held = torch.cat([torch.empty(0, dtype=torch.int64), *owned])
        assert torch.unique(held).numel() == held.numel()  # no slot owned twice
        assert bool(((held >= 0) & (held < host.capacity)).all())
        assert host.available + held.numel() == host.capacity  # nothing lost
    for slots in owned:
        host.free(slots)
    everything = host.alloc(host.capacity)
    assert everything is not None
    assert torch.equal(everything.sort()[0], torch.arange(host.capacity))


def test_freed_pages_come_back_as_one_run() -> None:
    _, host = make_pools("layer_first", page_size=2)
    first, second = host.alloc(6), host.alloc(6)
    assert first is not None and second is not None
    host.free(first.view(-1, 2)[[1, 0, 2]].reshape(-1))  # pages returned in any order
    again = host.alloc(6)
    assert again is not None
    assert torch.equal(again, torch.arange(int(first.min()), int(first.min()) + 6))


# ---------------------------------------------------------------- allocation


def test_host_pool_refuses_more_than_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "available_host_memory", lambda *a, **k: 10**9)
    nbytes = DeviceKVPool.token_bytes(32, 8, 128, torch.bfloat16) * 100_000  # ~13 GB
    with pytest.raises(HostMemoryError, match=r"--hicache-size or --hicache-ratio") as info:
        HostKVPool(32, 100_000, 8, 128, torch.bfloat16, CPU)
    assert f"{nbytes / 1e9:.2f} GB" in str(info.value) and "1.00 GB" in str(info.value)


def test_host_pool_allocation_method_and_close() -> None:
    _, host = make_pools("page_first", page_size=1)
    assert (host.method, host.pinned) == ("pageable", False)
    assert host.kv_buffer.shape == (2, 96, LAYERS, HEADS, DIM)
    assert host.nbytes == 96 * 2 * LAYERS * HEADS * DIM * 4
    host.close()
    host.close()
    assert host.kv_buffer.numel() == 0


def test_bad_layout_and_size() -> None:
    with pytest.raises(ValueError, match="layout"):
        HostKVPool(1, 8, 1, 2, torch.float32, CPU, layout="token_first")
    with pytest.raises(ValueError, match="at least one page"):
        HostKVPool(1, 3, 1, 2, torch.float32, CPU, page_size=4)


def test_host_pool_pins_for_musa(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool asks for pinned memory by the bare device type ("musa" for "musa:1")."""
    fake_musa = types.SimpleNamespace(is_available=lambda: True)
    monkeypatch.setattr(torch, "musa", fake_musa, raising=False)
    requests: list[dict[str, object]] = []
    real_empty = torch.empty

    def recording_empty(*size: object, **kwargs: object) -> torch.Tensor:
        requests.append(dict(kwargs))
        kwargs.pop("pin_memory", None)
        return real_empty(*size, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(torch, "empty", recording_empty)
    pretend_pinned(monkeypatch)  # pinned is read from the tensor
    host = HostKVPool(2, 8, 1, 4, torch.float16, platform.parse_device("MUSA:1"))
    assert [r for r in requests if "pin_memory" in r] == [
        {"dtype": torch.float16, "pin_memory": True}
    ]
    assert (host.method, host.pinned) == ("pin_memory", True)
    assert host.pinned_nbytes == host.nbytes == 256  # 8 tokens of 32 bytes: a power of two


def test_copy_planning_does_not_import_the_pool() -> None:
    # The dependency runs one way: host_pool uses host_copy, never the reverse (even for
    # types), so the copies can be read and changed without the pool's allocation code.
    import ast

    import engine.kvcache.host_copy as host_copy

    tree = ast.parse(Path(host_copy.__file__).read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "engine.kvcache.host_pool" not in modules
