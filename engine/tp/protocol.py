"""What rank 0 and the worker ranks share: the worker's start-up spec, the rendezvous keys,
the control group and the messages sent on it, and the KV size every rank agrees on.

Only rank 0 has a scheduler, an allocator and a prefix tree. Every other rank holds the
same KV geometry (same slot ids, same request-table rows, same host-tier slots) for its
own KV heads, and changes its KV exactly when rank 0 changes its own:

- request-table writes (``ReqTable``'s journal),
- host-tier copies, device -> host backups and host -> device loads (``KVCopy``),
- the forward of each batch (``StepInputs``).

NOTE: a step's message carries the writes and copies made since the previous one, in
order, and a rank applies them before that step's forward: the same order against the
forwards as on rank 0. Slot frees need no message (they move no bytes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine import platform
from engine.config import EngineConfig
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.sizing import kv_pool_tokens
from engine.model_runner import StepInputs

# A forward's all-reduce waits this long for a slow rank before it fails.
COLLECTIVE_TIMEOUT_S = 600.0
# Step messages: an idle server sends none, so workers may wait this long for the next.
CONTROL_TIMEOUT = timedelta(days=365)


class TPRankDiedError(RuntimeError):
    """A tensor-parallel worker process exited; the engine cannot run without it."""


class TPStepFailedError(RuntimeError):
    """Rank 0 failed inside a step: the group stops (its other ranks may be in a collective
    that rank 0 will never join, and rank 0's own state is half a step on)."""


@dataclass(frozen=True)
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


@dataclass
class KVCopy:
    """One host-tier copy rank 0 issued: ``backup`` (device -> host) or ``load``."""

    direction: str
    device_slots: torch.Tensor  # [N] int64, CPU
    host_slots: torch.Tensor  # [N] int64, CPU


@dataclass
class StepMessage:
    """Everything a rank does for one step; ``inputs`` None means: stop."""

    inputs: StepInputs | None
    table_writes: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    kv_copies: list[KVCopy] = field(default_factory=list)


@dataclass(frozen=True)
class KVGeometry:
    """Rank 0's KV sizes, which every rank copies so that slot ids mean the same."""

    num_slots: int
    max_rows: int
    max_context: int
    page_size: int
    host_tokens: int = 0  # 0: no host tier
    host_layout: str = "layer_first"
    host_alloc: str = "auto"


def rank_ready_key(rank: int) -> str:
    return f"hiserve/rank{rank}/started"


def new_control_group() -> Any:
    """The gloo group that carries step messages (made by every rank, in the same order)."""
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def broadcast(obj: object, control: Any) -> None:
    """Rank 0: send ``obj`` to every rank on the control group."""
    dist.broadcast_object_list([obj], src=0, group=control)


def receive(control: Any) -> Any:
    """Ranks 1..: the next object rank 0 broadcast on the control group."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def gather(value: object, control: Any) -> list[Any]:
    """Every rank: ``value`` of each rank, in rank order (on the control group; every rank
    calls it at the same point)."""
    gathered: list[Any] = [None] * dist.get_world_size(control)
    dist.all_gather_object(gathered, value, group=control)
    return gathered


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
    gathered = gather(local, control)
    return dataclasses.replace(config, kv_cache_tokens=min(int(t) for t in gathered))
