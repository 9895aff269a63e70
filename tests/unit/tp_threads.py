"""Tensor parallelism inside one process, for fast tests: each rank is a thread, and the
all-reduce is a sum over the threads' tensors (in rank order, so every rank gets the
same bits). The sharded layers cannot tell it from torch.distributed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from engine.layers.parallel_linear import TPShard

T = TypeVar("T")


class ThreadHub:
    """Where the ranks' threads meet to add up their partial sums."""

    def __init__(self, size: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=120)
        self.calls = 0

    def all_reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        self.parts[rank] = x.clone()
        self.barrier.wait()
        total = self.parts[0]
        assert total is not None
        for part in self.parts[1:]:
            assert part is not None
            total = total + part
        if rank == 0:
            self.calls += 1
        self.barrier.wait()  # nobody overwrites a part before every rank has read them
        return x.copy_(total)


@dataclass(frozen=True)
class ThreadShard(TPShard):
    hub: Any = field(default=None, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.hub.all_reduce(self.rank, x)


def thread_shards(size: int) -> list[ThreadShard]:
    hub = ThreadHub(size)
    return [ThreadShard(rank, size, hub=hub) for rank in range(size)]


def run_ranks(work: list[Callable[[], T]]) -> list[T]:
    """Run one callable per rank, each on its own thread; their results in rank order."""
    with ThreadPoolExecutor(len(work)) as pool:
        futures = [pool.submit(fn) for fn in work]
        return [f.result(timeout=300) for f in futures]
