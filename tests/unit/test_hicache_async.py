"""HiCache's asynchronous paths on a CPU machine (fake streams whose events complete when
told to), and the outcomes of eviction, load-back and backup at the edges."""

from __future__ import annotations

import torch

from engine.kvcache.allocator import OutOfSlotsError, PageAllocator
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.hicache import HiRadixCache
from engine.kvcache.host_pool import HostKVPool
from engine.kvcache.manager import KVCacheManager
from engine.kvcache.req_table import ReqTable
from engine.layers.attention import TorchAttentionBackend
from engine.layers.attention_meta import AttentionMetadata
from engine.platform import DeviceSpec
from engine.request import Req, SamplingParams
from tests.unit.fake_backends import FakeStreamBackend
from tests.unit.test_hicache_tree import admit_and_compute, check_kv_contents, check_shape

CPU = DeviceSpec("cpu", None)
LAYERS = 2


def make(
    num_slots: int,
    host_tokens: int,
    policy: str = "write_through",
    device: DeviceSpec = CPU,
    threshold: int = 1,
) -> tuple[KVCacheManager, HiRadixCache]:
    """A tree over CPU tensors; with a musa ``device`` its copies go through the fake
    streams (the data moves at once, the events complete only when told)."""
    allocator = PageAllocator(num_slots, 1)
    pool = DeviceKVPool(LAYERS, allocator.num_slots, 1, 4, torch.float32, "cpu")
    host = HostKVPool(LAYERS, host_tokens, 1, 4, torch.float32, CPU)
    tree = HiRadixCache(allocator, pool, host, policy, load_threshold=threshold, device=device)
    return KVCacheManager(allocator, ReqTable(8, 256, torch.device("cpu")), tree), tree


def serve(manager: KVCacheManager, name: str, prompt: list[int]) -> Req:
    """Admit, compute and release one request: its KV ends up in the tree."""
    req = Req(name, prompt, SamplingParams())
    assert admit_and_compute(manager, req)
    manager.release(req)
    return req


def node_of(tree: HiRadixCache, first_token: int):  # type: ignore[no-untyped-def]
    return next(n for n in tree.nodes() if n.key[0] == first_token)


CONVO = list(range(100, 110))  # served alone, all 10 tokens end up cached
OTHER = list(range(200, 210))
MUSA1 = DeviceSpec("musa", 1)


# ---------------------------------------------------------------- backups in flight


def test_backup_in_flight_locks_its_node_until_polled(fake_musa: FakeStreamBackend) -> None:
    manager, tree = make(24, 64, device=MUSA1)
    serve(manager, "a", CONVO)
    node = node_of(tree, 100)
    assert node.host_value is not None and node.lock_ref == 1  # locked by its backup
    assert tree.protected_tokens == 10
    tree.poll()
    assert node.lock_ref == 1  # the copy has not landed yet
    for event in fake_musa.events:
        event.complete = True
    # A decode-only phase never matches a waiting request: taking the next batch's load
    # handles must be enough to unlock what finished.
    assert tree.take_load_handles() == []
    assert node.lock_ref == 0 and tree.protected_tokens == 0
    assert tree.evictable_tokens == 10
    manager.check_invariants([])


def test_eviction_waits_for_backups_instead_of_giving_up(fake_musa: FakeStreamBackend) -> None:
    """All of the pool is held by nodes whose backups are in flight: a decode step that
    needs room waits for them rather than retracting or cutting a request short."""
    manager, tree = make(20, 64, device=MUSA1)
    serve(manager, "a", CONVO)
    serve(manager, "b", OTHER)
    assert manager.allocator.free_tokens == 0 and len(tree._pending) == 2
    req = Req("c", [300, 301, 302], SamplingParams())
    manager.admit(req)
    slots = manager.alloc(req, 3)  # raised OutOfSlotsError while the backups were locked
    assert slots.numel() == 3
    assert ("event_synchronize", "side1") in fake_musa.log
    assert tree._pending == []
    # Exactly three tokens' worth: the LRU leaf (CONVO, 10 tokens) went to the host tier.
    assert tree.evicted_device_tokens == 10
    convo = node_of(tree, 100)
    assert convo.value is None and convo.host_value is not None
    manager.check_invariants([req])
    check_shape(tree)


def test_flush_waits_for_backups_in_flight(fake_musa: FakeStreamBackend) -> None:
    manager, tree = make(24, 64, device=MUSA1)
    serve(manager, "a", CONVO)
    assert tree._pending
    assert tree.clear()  # refused (False) while the backup kept the node locked
    assert manager.allocator.free_tokens == manager.capacity
    assert tree.host_pool.available == tree.host_pool.capacity


def test_load_handles_feed_the_per_layer_wait_on_the_engine_device(
    fake_musa: FakeStreamBackend,
) -> None:
    manager, tree = make(24, 64, device=MUSA1)
    serve(manager, "a", CONVO)
    for event in fake_musa.events:
        event.complete = True
    tree.poll()
    assert tree.evict(10) == 10  # CONVO is host-only now
    back = Req("b", [*CONVO, 2], SamplingParams())
    manager.admit(back)
    assert back.cached_host == 10 and back.prefix_len == 10
    check_kv_contents(manager, back)  # the fake device pool is CPU memory: data moved
    handles = tree.take_load_handles()
    assert len(handles) == 1 and not handles[0].done()
    assert tree.take_load_handles() == []  # handed out once

    # One decode token of `back` through attention: every layer waits for its copy, on
    # musa:1's compute stream although this thread's current device is 0.
    slot = manager.alloc(back, 1)
    meta = AttentionMetadata(
        is_decode=True,
        out_slots=slot,
        req_rows=torch.tensor([back.row]),
        seq_lens=torch.tensor([back.kv_len]),
        req_table=manager.req_table.table,
        prefix_lens_list=[back.kv_len - 1],
        extend_lens_list=[1],
        seq_lens_list=[back.kv_len],
        max_seq_len=back.kv_len,
        kv_loads=handles,
    )
    q = torch.randn(1, 2, 4)
    kv = torch.randn(1, 1, 4)
    fake_musa.log.clear()
    for layer in range(LAYERS):
        TorchAttentionBackend().forward(q, kv, kv, layer, meta, tree.device_pool)
    assert fake_musa.log == [("wait_event", "side2", "compute1")] * LAYERS
    assert handles[0].layer_events[0] is not handles[0].layer_events[1]
    manager.check_invariants([back])


# ---------------------------------------------------------------- outcomes at the edges


def test_load_back_evicts_to_make_room() -> None:
    manager, tree = make(20, 64)
    serve(manager, "a", CONVO)
    tree.evict(10)  # CONVO to the host tier
    serve(manager, "b", OTHER)
    serve(manager, "c", [300, 301, 302, 303])
    assert manager.allocator.free_tokens == 20 - 10 - 4
    evicted_before = tree.evicted_device_tokens
    back = Req("d", [*CONVO, 2], SamplingParams())
    manager.admit(back)
    # 10 slots needed, 6 free: the LRU leaf (OTHER, 10 tokens) made room.
    assert back.cached_host == 10 and back.cached_device == 0
    check_kv_contents(manager, back)
    assert tree.evicted_device_tokens - evicted_before == 10
    other = node_of(tree, 200)
    assert other.value is None and other.host_value is not None
    assert node_of(tree, 300).value is not None  # the more recent one stayed
    assert tree.counters["loadback_tokens_total"] == 10
    manager.check_invariants([back])
    check_shape(tree)


def test_no_room_on_the_device_means_recompute() -> None:
    manager, tree = make(20, 64)
    serve(manager, "a", CONVO)
    tree.evict(10)
    hog = Req("hog", list(range(400, 416)), SamplingParams())
    manager.admit(hog)
    manager.alloc(hog, 16)  # owned by a running request: not evictable
    back = Req("b", [*CONVO, 2], SamplingParams())
    manager.admit(back)
    assert back.cached_host == 0 and back.prefix_len == 0
    assert tree.counters["loadback_tokens_total"] == 0
    assert node_of(tree, 100).host_value is not None  # still there for later
    assert manager.allocator.free_tokens == 4
    manager.check_invariants([hog, back])


def test_backup_fails_when_the_host_tier_is_full_of_device_nodes() -> None:
    manager, tree = make(24, 10)
    serve(manager, "a", CONVO)
    assert tree.host_pool.available == 0
    serve(manager, "b", OTHER)
    other = node_of(tree, 200)
    assert other.host_value is None  # no host slot: CONVO is still on the device
    assert tree.counters["backup_tokens_total"] == 10
    assert tree.counters["evicted_host_tokens_total"] == 0
    # Evicted from the device without a host copy, OTHER is gone, not host-only.
    tree.evict(20)
    assert [n.key[0] for n in tree.nodes()] == [100]
    assert node_of(tree, 100).host_value is not None
    assert tree.evicted_device_tokens == 20
    manager.check_invariants([])
    check_shape(tree)


def test_deleting_a_node_takes_its_host_only_descendants() -> None:
    manager, tree = make(40, 10)
    serve(manager, "x", OTHER)  # fills the host tier, stays on the device
    serve(manager, "a", CONVO)  # host full of device nodes: no backup
    assert node_of(tree, 100).host_value is None
    tree.evict(10)  # OTHER (LRU) becomes host-only
    serve(manager, "a2", [*CONVO, 7, 8, 9, 10, 11])  # extends CONVO by 5 tokens
    # Backing up the 5-token child evicted host-only OTHER to make room.
    assert tree.counters["evicted_host_tokens_total"] == 10
    child = node_of(tree, 7)
    assert child.parent is node_of(tree, 100) and child.host_value is not None
    tree.evict(5)  # the child goes host-only below its device-resident parent
    assert child.value is None
    tree.evict(10)  # the parent has no host copy: deleted, with its host-only child
    assert list(tree.nodes()) == []
    assert tree.host_cached_tokens == 0
    assert tree.host_pool.available == tree.host_pool.capacity
    assert tree.evicted_device_tokens == 10 + 5 + 10
    manager.check_invariants([])


def test_out_of_slots_is_still_raised_when_nothing_can_be_evicted() -> None:
    manager, _ = make(8, 16)
    hog = Req("hog", list(range(8)), SamplingParams())
    manager.admit(hog)
    manager.alloc(hog, 8)
    more = Req("more", [9, 9, 9], SamplingParams())
    manager.admit(more)
    try:
        manager.alloc(more, 1)
    except OutOfSlotsError as exc:
        assert "free after eviction" in str(exc)
    else:
        raise AssertionError("allocation past the pool succeeded")
