"""Shutdown with copies in flight: the host tier is released only after every copy and the
device are done, and never under a running engine loop. Fake streams, CPU tensors."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.kv_setup import KVSetup
from engine.kvcache.allocator import PageAllocator
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.hicache import HiRadixCache
from engine.kvcache.host_pool import HostKVPool
from engine.kvcache.manager import KVCacheManager
from engine.kvcache.req_table import ReqTable
from engine.platform import DeviceSpec
from engine.request import Req, SamplingParams
from tests.unit.fake_backends import FakeStreamBackend
from tests.unit.test_hicache_tree import admit_and_compute

MUSA1 = DeviceSpec("musa", 1)


def test_host_tier_is_released_after_copies_and_device_finish(
    fake_musa: FakeStreamBackend,
) -> None:
    allocator = PageAllocator(24, 1)
    pool = DeviceKVPool(2, allocator.num_slots, 1, 4, torch.float32, "cpu")
    host = HostKVPool(2, 64, 1, 4, torch.float32, DeviceSpec("cpu"))
    tree = HiRadixCache(allocator, pool, host, device=MUSA1)
    table = ReqTable(4, 64, torch.device("cpu"))
    manager = KVCacheManager(allocator, table, tree)
    req = Req("a", list(range(100, 110)), SamplingParams())
    assert admit_and_compute(manager, req)
    manager.release(req)  # write-through backup now in flight on side1
    assert tree.transfer.num_in_flight == 1
    real_release = host.allocation.release

    def logged_release() -> None:
        fake_musa.log.append(("release",))
        real_release()

    host.allocation.release = logged_release  # type: ignore[method-assign]
    setup = KVSetup(pool, table, manager, host, MUSA1)
    fake_musa.log.clear()
    setup.close()
    assert fake_musa.log == [("event_synchronize", "side1"), ("synchronize", 1), ("release",)]
    assert tree.transfer.num_in_flight == 0


class BlockingEngine:
    """Just enough of Engine for AsyncEngine: one step that blocks until released."""

    def __init__(self) -> None:
        self.config = EngineConfig()
        self.tokenizer = None
        self.model_path = "stub"
        self.max_model_len = 64
        self.vocab_size = 16
        self.served_model_name = "stub"
        self.device_spec = MUSA1
        self.has_work = True
        self.in_step = threading.Event()
        self.release_step = threading.Event()
        self.closed_by: list[str] = []

    def stats(self) -> dict[str, float]:
        return {"waiting": 0}

    def prepare_grammar(self) -> bool:
        return False  # no grammar backend: structured outputs are refused

    def health(self) -> dict[str, Any]:
        return {}

    def step(self) -> list[Any]:
        self.in_step.set()
        self.release_step.wait()
        self.has_work = False
        return []

    def close(self) -> None:
        self.closed_by.append(threading.current_thread().name)


def test_engine_is_never_closed_under_a_running_loop(fake_musa: FakeStreamBackend) -> None:
    engine = BlockingEngine()
    async_engine = AsyncEngine(engine.config, engine=engine)  # type: ignore[arg-type]
    async_engine.join_timeout_s = 0.05
    async_engine.start()
    assert engine.in_step.wait(30)
    asyncio.run(async_engine.shutdown(grace_s=0))
    thread = async_engine._thread
    assert thread is not None and thread.is_alive()
    assert engine.closed_by == []  # copies of the running step may still use host memory
    engine.release_step.set()
    thread.join(30)
    assert engine.closed_by == ["hiserve-engine"]  # closed once, when the loop ended
    # The loop thread made the engine's device current before its first step.
    assert ("set_device", 1, "hiserve-engine") in fake_musa.log


def test_engine_closed_once_by_shutdown_after_a_clean_stop(fake_musa: FakeStreamBackend) -> None:
    engine = BlockingEngine()
    engine.release_step.set()
    async_engine = AsyncEngine(engine.config, engine=engine)  # type: ignore[arg-type]
    async_engine.start()
    assert engine.in_step.wait(30)
    asyncio.run(async_engine.shutdown(grace_s=0))
    assert async_engine._thread is not None and not async_engine._thread.is_alive()
    assert len(engine.closed_by) == 1
