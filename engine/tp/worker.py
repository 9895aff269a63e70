"""A tensor-parallel worker process (ranks 1..N-1): load this rank's shard, mirror rank 0's
KV, and run the forward of every step rank 0 sends until it says stop.

Started by engine/tp/runtime.py with the ``spawn`` method. Any error ends the process
with a non-zero status after logging it; rank 0's monitor then takes the server down. A
monitor of this process ends it when rank 0 exits (engine/tp/liveness.py), also while the
forward waits in a collective that rank 0 will never join.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from engine import dtypes, loader, platform
from engine.graph_setup import build_decode_graphs, build_mixed_graphs
from engine.heap import keep_freed_memory
from engine.layers.parallel_linear import TPShard
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from engine.tp import collectives
from engine.tp.liveness import watch_parent
from engine.tp.mirror import RankKV
from engine.tp.protocol import (
    COLLECTIVE_TIMEOUT_S,
    KVGeometry,
    StepMessage,
    WorkerSpec,
    agreed_kv_config,
    gather,
    new_control_group,
    rank_ready_key,
    receive,
)

logger = logging.getLogger("hiserve.tp")


def worker_main(spec: WorkerSpec) -> None:
    """Process entry point; exits 0 after rank 0's stop, 1 on any error."""
    logging.basicConfig(
        level=spec.log_level,
        format=f"%(asctime)s %(levelname)s %(name)s [tp rank {spec.rank}]: %(message)s",
    )
    monitor = watch_parent(_rank0_died)
    try:
        serve_rank(spec)
    except BaseException:
        logger.exception("tensor-parallel rank %d failed", spec.rank)
        sys.exit(1)
    finally:
        if monitor is not None:
            monitor.stop()


def _rank0_died(rank: int) -> None:
    # NOTE: os._exit, not sys.exit: the main thread may be blocked in a collective (NCCL
    # waits for its 600 s timeout), and a normal exit would wait for it.
    logger.error("rank %d (the server) exited; this rank exits too", rank)
    os._exit(1)


def serve_rank(spec: WorkerSpec) -> None:
    """Join the group, load the shard, size the KV with rank 0, then follow its steps."""
    config = spec.config
    device_spec = spec.device
    platform.set_device(device_spec)
    device = platform.to_torch_device(device_spec)
    if device.type == "cpu":
        torch.set_num_threads(spec.num_threads)
    keep_freed_memory()  # as rank 0 does (engine/build.py)
    dtype = dtypes.parse_dtype(config.dtype, device_spec)
    torch.manual_seed(config.seed)
    store = dist.FileStore(spec.store_path, spec.size)
    store.set(rank_ready_key(spec.rank), "1")
    collectives.init_process_group(
        device_spec, spec.rank, spec.size, timeout_s=COLLECTIVE_TIMEOUT_S, store=store
    )
    control = new_control_group()
    model: Any = loader.load_model(
        spec.model_path,
        device,
        dtype,
        config.attention_backend,
        tp=TPShard(spec.rank, spec.size),
    )
    kv_dtype = dtypes.kv_cache_dtype(config.kv_cache_dtype, dtype, device_spec)
    agreed_kv_config(config, model.config, device_spec, kv_dtype, control)
    geometry: KVGeometry = receive(control)
    kv = RankKV(geometry, model.config, kv_dtype, device, device_spec)
    # In lockstep with rank 0's build_decode_graphs and build_mixed_graphs (engine/build.py).
    share = functools.partial(gather, control=control)
    graphs = build_decode_graphs(config, model, kv, device_spec, device, gather=share)
    mixed_graphs = build_mixed_graphs(config, model, kv, graphs, device_spec, device, share)
    runner = ModelRunner(
        model,
        kv.device_pool,
        kv.req_table,
        Sampler(int(model.config.vocab_size), device),
        device,
        (),
        graphs=graphs,
        mixed_graphs=mixed_graphs,
    )
    logger.info("rank %d ready on %s", spec.rank, device_spec)
    try:
        with torch.inference_mode():
            while True:
                message: StepMessage = receive(control)
                loads = kv.apply(message)
                if message.inputs is None:
                    break
                runner.follow(message.inputs, loads)
    finally:
        kv.close()
        if graphs is not None:
            logger.info(
                "rank %d: %d decode steps replayed from device graphs",
                spec.rank,
                sum(graphs.replays.values()),
            )
        if mixed_graphs is not None:
            logger.info(
                "rank %d: %d steps that prefill replayed from device graphs",
                spec.rank,
                sum(mixed_graphs.replays.values()),
            )
    # NOTE: destroy is collective on NCCL; leaving the group must not wait for rank 0.
    collectives.leave_group(dist.get_backend())
