"""Tensor parallelism on rank 0: start one worker process per extra device, agree on the
KV sizes, send every step to the workers, and notice when one of them dies.

Rank 0 is the engine in the server process: it schedules, samples and owns the prefix
tree; workers (engine/tp/worker.py) run the same forward on their shard of the weights.
Two process groups: the device backend's (nccl, mccl, ... ; gloo on CPU) for the
all-reduces inside the forward, and a gloo group for the step messages.

NOTE: a worker that dies takes the server down, on every backend: a monitor thread waits
on the workers' process sentinels (engine/tp/liveness.py, never the collective backend),
records the failure (``failure``, ``watch``), ends the other workers and aborts rank 0's
communicators, so a forward blocked in an NCCL/MCCL all-reduce with the dead rank returns
instead of waiting out the 600 s collective timeout (a gloo one raises by itself). A
failure of rank 0's own step (``fail``) stops the group the same way. Every wait on a
worker or a communicator has a deadline.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist

from engine import platform
from engine.config import EngineConfig
from engine.kv_setup import KVSetup
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.host_pool import HostKVPool
from engine.kvcache.req_table import TableJournal
from engine.layers.parallel_linear import TPShard
from engine.model_runner import StepInputs
from engine.tp import collectives
from engine.tp.failure import GroupFailure
from engine.tp.liveness import LivenessMonitor, end_processes, run_bounded
from engine.tp.mirror import MirroredKVTransfer
from engine.tp.protocol import (
    COLLECTIVE_TIMEOUT_S,
    KVCopy,
    KVGeometry,
    StepMessage,
    TPRankDiedError,
    WorkerSpec,
    agreed_kv_config,
    broadcast,
    gather,
    new_control_group,
    rank_ready_key,
)
from engine.tp.worker import worker_main

logger = logging.getLogger("hiserve.tp")

# An orderly stop: the workers apply the stop message, close their KV and exit.
STOP_JOIN_S = 30.0
# The stop message (a worker that cannot take it is ended anyway), and leaving the group.
SEND_STOP_S = 10.0
LEAVE_GROUP_S = 10.0


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


class TPRuntime:
    """Rank 0's side of a tensor-parallel group of ``config.tensor_parallel_size`` ranks."""

    def __init__(self, config: EngineConfig, spec: platform.DeviceSpec, model_path: Path) -> None:
        self.size = int(config.tensor_parallel_size)
        visible = platform.backend_module(spec.type)
        count = int(visible.device_count()) if visible is not None else None
        devices = collectives.rank_devices(
            spec, self.size, device_ids(config.tensor_parallel_devices), count
        )
        backend = collectives.check_collective_backend(spec)
        self.backend = backend
        self._lock = threading.Lock()
        self._stopping = False
        self.stop_join_s = STOP_JOIN_S
        self._attached = False  # workers follow steps once share_geometry() ran
        # Written by rank 0's request table and tree, sent (and cleared) with each step.
        self.table_journal: TableJournal = []
        self.kv_journal: list[KVCopy] = []
        self._tmp = tempfile.mkdtemp(prefix="hiserve-tp-")
        store_path = os.path.join(self._tmp, "rendezvous")
        store = dist.FileStore(store_path, self.size)
        threads = max(1, (os.cpu_count() or 1) // self.size)
        context = multiprocessing.get_context("spawn")

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
        # NOTE: gloo raises at once when a peer dies; NCCL and MCCL wait for their
        # timeout unless the group is aborted.
        abort = None if backend == "gloo" else collectives.abort_collectives
        self._failure = GroupFailure(self.workers, abort, lambda s: self.stop(join_s=s))
        self._monitor = LivenessMonitor(
            {p.sentinel: rank for rank, p in enumerate(self.workers, start=1)},
            self._failure.worker_died,
            name="hiserve-tp-monitor",
        )
        self._monitor.start()
        try:
            wait_for_ranks(store, self.workers)
            collectives.init_process_group(
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

    def make_transfer(
        self,
        device_pool: DeviceKVPool,
        host_pool: HostKVPool,
        device: platform.DeviceSpec | None,
    ) -> MirroredKVTransfer:
        """The host tier's copier for rank 0's tree: it records each copy for the workers."""
        return MirroredKVTransfer(device_pool, host_pool, device, self.kv_journal)

    def gather(self, value: object) -> list[Any]:
        """Rank 0's side of a gather every rank makes at the same point of start-up."""
        return gather(value, self.control)

    def share_geometry(self, kv: KVSetup) -> None:
        """Send rank 0's KV geometry to the workers; they build their KV and decode graphs
        (in lockstep with rank 0's, engine/graph_setup.py), then follow its steps
        (``send_step``, the runner's ``on_step``)."""
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
        broadcast(geometry, self.control)
        self._attached = True

    # ------------------------------------------------------------------ steps
    def send_step(self, inputs: StepInputs | None) -> None:
        """Send the writes and copies since the last step, and ``inputs``, to every worker."""
        if self.failure is not None:
            raise self.failure
        message = StepMessage(inputs, list(self.table_journal), list(self.kv_journal))
        self.table_journal.clear()
        self.kv_journal.clear()
        broadcast(message, self.control)

    # ------------------------------------------------------------------ failure
    @property
    def failure(self) -> BaseException | None:
        """Why the group can no longer run (a worker died, rank 0's step failed), or None."""
        return self._failure.error

    def watch(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` (on the thread that found it) when the group fails."""
        self._failure.watch(callback)

    def fail(self, error: BaseException) -> None:
        """Rank 0's step raised ``error``: the group stops (see engine/tp/failure.py)."""
        self._failure.step_failed(error)

    # ------------------------------------------------------------------ shutdown
    def stop(self, graceful: bool = True, join_s: float | None = None) -> None:
        """Stop the workers: a stop message when the group is whole and they wait for one,
        then up to ``join_s`` (``stop_join_s``) for them to exit, then terminate and kill
        the rest; then leave the group. Bounded: never hangs on a broken communicator."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._monitor.stop()  # from here on a worker exits on purpose
        orderly = (
            graceful
            and self._attached
            and not self._failure.broken
            and dist.is_initialized()
            and all(p.is_alive() for p in self.workers)
        )
        if orderly:
            stop = StepMessage(None)
            orderly = run_bounded(
                partial(broadcast, stop, self.control), SEND_STOP_S, "sending the stop message"
            )
        wait_s = self.stop_join_s if join_s is None else join_s
        end_processes(self.workers, wait_s if orderly else 0.0)
        if self.backend == "gloo":
            # Local (it waits for no peer), and done before a new group may be made.
            collectives.leave_group(self.backend)
        else:
            leave = partial(collectives.leave_group, self.backend)
            run_bounded(leave, LEAVE_GROUP_S, "leaving the group")
        shutil.rmtree(self._tmp, ignore_errors=True)
