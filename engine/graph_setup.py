"""Whether decode steps replay device graphs, and the runner that replays them.

``build_decode_graphs`` is the engine build's one call: it says why graphs stay off
(turned off, a device without a graph API, tensor parallelism, a model whose decode
cannot be captured) or builds the ``DecodeGraphRunner`` (engine/graph_runner.py) and,
for attention that reads the pool in place, captures every bucket before serving
(engine/graph_startup.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine import graph_startup, platform
from engine.config import EngineConfig
from engine.graph_runner import DecodeGraphRunner
from engine.kv_setup import KVSetup
from engine.layers.moe import DEVICE_ROUTING_MAX_TOKENS, SparseMoE

logger = logging.getLogger(__name__)


def graph_blockers(model: torch.nn.Module, max_batch: int = 1) -> list[str]:
    """Why a decode step of ``model`` (up to ``max_batch`` rows) cannot be captured
    (empty: it can).

    Captured work must not read tensor values on the host nor take shapes from per-step
    Python values; windowed PyTorch attention loops over sequences with their own
    lengths, and MoE routing past DEVICE_ROUTING_MAX_TOKENS reads the chosen experts back
    to the host.
    """
    reasons: set[str] = set()
    for module in model.modules():
        backend = getattr(module, "attn_backend", None)
        if backend is not None and not getattr(backend, "graph_safe_decode", False):
            reasons.add(f"attention backend {backend.name!r} sizes its work per sequence")
        if isinstance(module, SparseMoE) and max_batch > DEVICE_ROUTING_MAX_TOKENS:
            reasons.add(
                f"mixture-of-experts routing reads the chosen experts on the host past "
                f"{DEVICE_ROUTING_MAX_TOKENS} tokens (--cuda-graph-max-bs to stay under it)"
            )
    return sorted(reasons)


def build_decode_graphs(
    config: EngineConfig,
    model: Any,
    kv: KVSetup,
    spec: platform.DeviceSpec,
    device: torch.device,
) -> DecodeGraphRunner | None:
    """The engine's decode graph runner, or None (logged) where decode stays eager:
    turned off, a device without graphs (cpu, mps, npu, xpu), tensor parallelism (not
    supported yet: ranks would have to replay in lockstep), or a model with work that
    cannot be captured."""
    if config.disable_cuda_graph:
        logger.info("device graphs: off (--disable-cuda-graph)")
        return None
    api = platform.graph_api(spec)
    if api is None:
        if spec.type != "cpu":
            logger.info("device graphs: %s has no graph API; decode runs eagerly", spec.type)
        return None
    if config.tensor_parallel_size > 1:
        logger.info(
            "device graphs: off under tensor parallelism (tp=%d); decode runs eagerly",
            config.tensor_parallel_size,
        )
        return None
    max_batch = min(
        config.cuda_graph_max_bs or config.max_running_requests, config.max_running_requests
    )
    blockers = graph_blockers(model, max_batch)
    if blockers:
        logger.warning(
            "device graphs: off for this model (%s); decode runs eagerly", "; ".join(blockers)
        )
        return None
    runner = DecodeGraphRunner(
        model, kv.device_pool, kv.req_table, device, max_batch, api=api, spec=spec
    )
    if runner.in_place:
        failure = graph_startup.capture_at_start(runner)
        if failure is not None:
            logger.warning("device graphs: off, decode runs eagerly: %s", failure)
            runner.graphs.clear()
            return None
        runner.captured_at_start = True
        return runner
    logger.info(
        "device graphs: on for decode batches up to %d (buckets %s) and contexts up to %d "
        "(buckets %s); the gather fallback captures lazily, at most %d",
        runner.max_batch,
        runner.batch_buckets,
        runner.context_buckets[-1],
        runner.context_buckets,
        runner.max_graphs,
    )
    return runner
