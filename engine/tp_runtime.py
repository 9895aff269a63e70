"""Tensor parallelism on rank 0: start one worker process per extra device, agree on the
KV sizes, send every step to the workers, and notice when one of them dies.

Rank 0 is the engine in the server process: it schedules, samples and owns the prefix
tree; workers (engine/tp_worker.py) run the same forward on their shard of the weights.
Two process groups: the device backend's (nccl, mccl, ... ; gloo on CPU) for the
all-reduces inside the forward, and a gloo group for the step messages.

NOTE: a worker that dies takes the server down: a monitor thread waits on the workers'
process sentinels and reports the failure (``failure``, ``watch``); a collective with a
dead gloo peer raises at once, so rank 0 never hangs waiting for it.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engine import distributed, platform
from engine.config import EngineConfig
from engine.kv_setup import KVSetup, kv_pool_tokens
from engine.kvcache.device_pool import DeviceKVPool
from engine.layers.parallel_linear import TPShard
from engine.model_runner import ModelRunner, StepInputs
from engine.tp_mirror import KVCopy, KVGeometry, MirroredKVTransfer, StepMessage

logger = logging.getLogger("hiserve.tp")

# A forward's all-reduce waits this long for a slow rank before it fails.
COLLECTIVE_TIMEOUT_S = 600.0
# Step messages: an idle server sends none, so workers may wait this long for the next.
CONTROL_TIMEOUT = timedelta(days=365)
STOP_JOIN_S = 30.0


class TPRankDiedError(RuntimeError):
    """A tensor-parallel worker process exited; the engine cannot run without it."""


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to join the group and load its shard."""

    rank: int
    size: int
    device: platform.DeviceSpec
    store_path: str  # the FileStore of the rendezvous
    config: EngineConfig
    model_path: str
    log_level: int
    num_threads: int  # CPU ranks: torch threads, so ranks do not fight over cores


def device_ids(text: str | None) -> list[int] | None:
    """``"2,3"`` -> ``[2, 3]``; None/empty -> None (consecutive from --device's index)."""
    if not text or not text.strip():
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"tensor_parallel_devices={text!r} must list device indices, e.g. '0,1'"
        ) from None


def rank_ready_key(rank: int) -> str:
    return f"hiserve/rank{rank}/started"


def wait_for_ranks(store: dist.Store, workers: list[Any]) -> None:
    """Wait until every worker (rank 1..) has started and is about to join the group;
    raise TPRankDiedError at once if one exits first (never wait out the timeout)."""
    keys = [rank_ready_key(rank) for rank in range(1, len(workers) + 1)]
    while not store.check(keys):
        dead = [(r, p) for r, p in enumerate(workers, start=1) if not p.is_alive()]
        if dead:
            rank, process = dead[0]
            raise TPRankDiedError(
                f"tensor-parallel rank {rank} (pid {process.pid}) exited with code "
                f"{process.exitcode} while starting (its log lines above say why)"
            )
        # Blocks until a worker exits or 0.2 s pass, whichever is first.
        multiprocessing.connection.wait([p.sentinel for p in workers], timeout=0.2)


def new_control_group() -> Any:
    """The gloo group that carries step messages (made by every rank, in the same order)."""
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def agreed_kv_config(
    config: EngineConfig,
    shard_config: Any,
    spec: platform.DeviceSpec,
    dtype: torch.dtype,
    control: Any,
) -> EngineConfig:
    """``config`` with ``kv_cache_tokens`` set to the smallest pool any rank can hold (every
    rank sizes its own from its free memory; slot ids must mean the same on all)."""
    per_token = DeviceKVPool.token_bytes(
        int(shard_config.num_hidden_layers),
        int(shard_config.num_key_value_heads),
        int(shard_config.head_dim),
        dtype,
    )
    local = kv_pool_tokens(config, spec, per_token)
    gathered: list[Any] = [None] * dist.get_world_size(control)
    dist.all_gather_object(gathered, local, group=control)
    return dataclasses.replace(config, kv_cache_tokens=min(int(t) for t in gathered))


class TPRuntime:
    """Rank 0's side of a tensor-parallel group of ``config.tensor_parallel_size`` ranks."""

    def __init__(self, config: EngineConfig, spec: platform.DeviceSpec, model_path: Path) -> None:
        self.size = int(config.tensor_parallel_size)
        visible = platform.backend_module(spec.type)
        count = int(visible.device_count()) if visible is not None else None
        devices = distributed.rank_devices(
            spec, self.size, device_ids(config.tensor_parallel_devices), count
        )
        backend = distributed.check_collective_backend(spec)
        self.failure: BaseException | None = None
        self._callbacks: list[Callable[[BaseException], None]] = []
        self._lock = threading.Lock()
        self._stopping = False
        self._attached = False  # workers follow steps once attach() ran
        self._journal: list[KVCopy] = []
        self._table_journal: list[tuple[int, int, torch.Tensor]] = []
        self._tmp = tempfile.mkdtemp(prefix="hiserve-tp-")
        store_path = os.path.join(self._tmp, "rendezvous")
        store = dist.FileStore(store_path, self.size)
        threads = max(1, (os.cpu_count() or 1) // self.size)
        context = multiprocessing.get_context("spawn")
        from engine.tp_worker import worker_main

        self.workers = []
        for rank in range(1, self.size):
            worker_spec = WorkerSpec(
                rank,
                self.size,
                devices[rank],
                store_path,
                config,
                str(model_path),
                logging.getLogger().getEffectiveLevel(),
                threads,
            )
            process = context.Process(
                target=worker_main, args=(worker_spec,), name=f"hiserve-tp{rank}", daemon=True
            )
            process.start()
            self.workers.append(process)
        logger.info(
            "tensor parallel: %d ranks on %s (%s), workers %s",
            self.size,
            ", ".join(str(d) for d in devices),
            backend,
            [p.pid for p in self.workers],
        )
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._monitor = threading.Thread(target=self._watch, name="hiserve-tp-monitor", daemon=True)
        self._monitor.start()
        try:
            wait_for_ranks(store, self.workers)
            distributed.init_process_group(
                devices[0], 0, self.size, timeout_s=COLLECTIVE_TIMEOUT_S, store=store
            )
            self.control = new_control_group()
        except BaseException:
            self.stop(graceful=False)
            raise
        self.shard = TPShard(0, self.size)

    # ------------------------------------------------------------------ set-up
    def agree_kv(
        self, config: EngineConfig, shard_config: Any, spec: platform.DeviceSpec, dtype: Any
    ) -> EngineConfig:
        return agreed_kv_config(config, shard_config, spec, dtype, self.control)

    def attach(self, kv: KVSetup, runner: ModelRunner) -> None:
        """Share rank 0's KV geometry with the workers; from now on record every table
        write and host-tier copy, and send each step's forward to the workers."""
        host = kv.host_pool
        geometry = KVGeometry(
            num_slots=kv.device_pool.num_slots,
            max_rows=kv.req_table.max_rows,
            max_context=kv.req_table.max_context,
            page_size=kv.manager.allocator.page_size,
            host_tokens=host.capacity if host is not None else 0,
            host_layout=host.layout if host is not None else "layer_first",
            host_alloc=host.method if host is not None else "auto",
        )
        self._broadcast(geometry)
        kv.req_table.journal = self._table_journal
        tree: Any = kv.manager.tree
        if host is not None:
            tree.transfer = MirroredKVTransfer(kv.device_pool, host, kv.spec, self._journal)
        runner.on_step = self.send_step
        self._attached = True

    # ------------------------------------------------------------------ steps
    def send_step(self, inputs: StepInputs | None) -> None:
        """Send the writes and copies since the last step, and ``inputs``, to every worker."""
        if self.failure is not None:
            raise self.failure
        message = StepMessage(inputs, list(self._table_journal), list(self._journal))
        self._table_journal.clear()
        self._journal.clear()
        self._broadcast(message)

    def _broadcast(self, obj: object) -> None:
        dist.broadcast_object_list([obj], src=0, group=self.control)

    # ------------------------------------------------------------------ failure
    def watch(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` (on the monitor thread) when a worker dies."""
        with self._lock:
            failure = self.failure
            if failure is None:
                self._callbacks.append(callback)
        if failure is not None:
            callback(failure)

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.workers, start=1)}
        ready = multiprocessing.connection.wait([*sentinels, self._wake_r])
        if self._stopping:
            return
        rank, process = next(sentinels[s] for s in ready if s in sentinels)  # type: ignore[index]
        process.join(timeout=1.0)
        error = TPRankDiedError(
            f"tensor-parallel rank {rank} (pid {process.pid}) exited with code "
            f"{process.exitcode}; the engine cannot run without it and shuts down "
            "(the rank's own log lines above say why)"
        )
        logger.error("%s", error)
        with self._lock:
            self.failure = error
            callbacks = list(self._callbacks)
        for callback in callbacks:
            try:
                callback(error)
            except Exception:  # e.g. the server's event loop already closed
                logger.exception("a tensor-parallel failure callback failed")

    # ------------------------------------------------------------------ shutdown
    def stop(self, graceful: bool = True) -> None:
        """Stop the workers (with a stop message when all of them are alive and waiting for
        one; else terminate them), then leave the group."""
        if self._stopping:
            return
        self._stopping = True
        self._wake_w.send(None)
        graceful = graceful and self._attached
        alive = graceful and all(p.is_alive() for p in self.workers)
        if alive and self.failure is None and dist.is_initialized():
            try:
                self.send_step(None)
            except Exception as exc:  # a worker died meanwhile: terminate below
                logger.warning("could not stop the tensor-parallel workers cleanly: %s", exc)
        for process in self.workers:
            process.join(timeout=STOP_JOIN_S if alive else 0.1)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5.0)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # pragma: no cover - backend dependent
                logger.warning("leaving the tensor-parallel group failed: %s", exc)
        shutil.rmtree(self._tmp, ignore_errors=True)
