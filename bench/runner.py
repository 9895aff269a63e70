"""Drives one workload against one target: arrivals, concurrency, conversation order."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.client import FATAL_ERRORS, CompletionClient, RequestResult, TargetError
from bench.workloads import BenchRequest, Workload


@dataclass(frozen=True)
class RunOptions:
    """How requests are released: Poisson arrivals, a concurrency cap, or both."""

    request_rate: float = math.inf  # requests/s; inf: send as soon as a slot is free
    max_concurrency: int | None = None  # None: unlimited
    flush_cache: bool = True
    progress: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


@dataclass
class RunState:
    """Everything one run has measured so far; readable after an interrupt, too."""

    label: str
    base_url: str
    total_requests: int
    model: str | None = None
    results: list[RequestResult] = field(default_factory=list)  # in completion order
    dispatch_order: list[int] = field(default_factory=list)  # request indices as sent
    start_time: float | None = None
    end_time: float | None = None
    aborted: str | None = None  # why the run stopped early; None: it did not
    cache_flushed: bool | None = None  # None: not attempted

    @property
    def duration(self) -> float:
        if self.start_time is None:
            return 0.0
        return (self.end_time or time.perf_counter()) - self.start_time

    @property
    def not_sent(self) -> int:
        return self.total_requests - len(self.dispatch_order)

    def results_in_dispatch_order(self) -> list[RequestResult]:
        by_index = {r.index: r for r in self.results}
        return [by_index[i] for i in self.dispatch_order if i in by_index]


class _Dispatcher:
    """Releases requests in nominal order, one in flight per conversation.

    NOTE: a request is ready when no earlier request of its conversation is pending or
    in flight. At each arrival the first ready request in nominal order goes out, so a
    multiturn run cycles through the clients and every conversation's prefix has to
    survive the other clients' rounds in the cache.
    """

    def __init__(
        self, client: CompletionClient, workload: Workload, options: RunOptions, state: RunState
    ) -> None:
        self.client = client
        self.options = options
        self.state = state
        self.pending: list[BenchRequest] = list(workload.requests)
        self.busy: set[int] = set()  # conversations with a request in flight
        self.changed = asyncio.Event()
        self.slots = asyncio.Semaphore(options.max_concurrency) if options.max_concurrency else None
        self.tasks: set[asyncio.Task[None]] = set()
        self.bar = tqdm(
            total=len(self.pending),
            desc=state.label,
            unit="req",
            leave=False,
            disable=None if options.progress else True,
        )

    def _next_ready(self) -> BenchRequest | None:
        seen: set[int] = set()
        for request in self.pending:
            if request.conversation not in self.busy and request.conversation not in seen:
                return request
            seen.add(request.conversation)
        return None

    async def run(self) -> None:
        rng = np.random.default_rng(self.options.seed + 7919)
        next_arrival = time.perf_counter()
        try:
            while self.pending and self.state.aborted is None:
                if math.isfinite(self.options.request_rate):
                    next_arrival += float(rng.exponential(1.0 / self.options.request_rate))
                    await asyncio.sleep(max(0.0, next_arrival - time.perf_counter()))
                if self.slots is not None:
                    await self.slots.acquire()
                request = await self._wait_ready()
                if request is None:
                    if self.slots is not None:
                        self.slots.release()
                    break
                self._dispatch(request)
            if self.tasks:
                await asyncio.gather(*self.tasks)
        finally:
            for task in self.tasks:
                task.cancel()
            self.bar.close()

    async def _wait_ready(self) -> BenchRequest | None:
        while self.state.aborted is None:
            request = self._next_ready()
            if request is not None:
                return request
            self.changed.clear()
            await self.changed.wait()
        return None

    def _dispatch(self, request: BenchRequest) -> None:
        self.pending.remove(request)
        self.busy.add(request.conversation)
        if self.state.start_time is None:
            self.state.start_time = time.perf_counter()
        self.state.dispatch_order.append(request.index)
        task = asyncio.create_task(self._send(request))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _send(self, request: BenchRequest) -> None:
        try:
            result = await self.client.complete(request)
        finally:
            self.busy.discard(request.conversation)
            if self.slots is not None:
                self.slots.release()
            self.changed.set()
        self.state.results.append(result)
        self.state.end_time = time.perf_counter()
        self.bar.update(1)
        if not result.ok and result.error_kind in FATAL_ERRORS and self.state.aborted is None:
            self.state.aborted = result.error


async def run_workload(
    client: CompletionClient, workload: Workload, options: RunOptions, state: RunState
) -> RunState:
    """Probe the target, flush its cache, send the workload; fills ``state`` as it goes.

    Fatal target errors (refused connections, a rejected key) stop the run early and are
    recorded in ``state.aborted``; an interrupt leaves ``state`` holding what completed.
    """
    try:
        models = await client.probe()
        if client.model is None:
            client.model = models[0] if models else "default"
        state.model = client.model
        if options.flush_cache:
            state.cache_flushed = await client.flush_cache()
    except TargetError as exc:
        state.aborted = str(exc)
        return state
    dispatcher = _Dispatcher(client, workload, options, state)
    try:
        await dispatcher.run()
    except asyncio.CancelledError:
        state.aborted = state.aborted or "interrupted"
        raise
    finally:
        if state.end_time is None and state.start_time is not None:
            state.end_time = time.perf_counter()
    return state


def run_blocking(
    state: RunState, workload: Workload, options: RunOptions, **client_kwargs: Any
) -> RunState:
    """Run one workload on a fresh event loop against ``state.base_url``.

    A KeyboardInterrupt propagates to the caller, and ``state`` still holds what completed.
    """

    async def main() -> RunState:
        client = CompletionClient(state.base_url, **client_kwargs)
        try:
            return await run_workload(client, workload, options, state)
        finally:
            with contextlib.suppress(Exception):
                await client.aclose()

    return asyncio.run(main())
