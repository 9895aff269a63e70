"""Whether decode steps replay device graphs, and the runner that replays them.

``build_decode_graphs`` is the engine build's one call (on every tensor-parallel rank):
it says why graphs stay off (turned off, a device without a graph API, a model whose
decode cannot be captured, tensor parallelism with the gather fallback) or builds the
``DecodeGraphRunner`` (engine/graph_runner.py) and, for attention that reads the pool in
place, captures every bucket before serving (engine/graph_startup.py), the ranks of a
tensor-parallel group in lockstep. ``build_mixed_graphs`` does the same for steps that
prefill (engine/mixed_graphs.py), where mixed batches are on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

import torch

from engine import graph_startup, platform
from engine.config import EngineConfig, default_max_prefill_tokens
from engine.graph_buckets import batch_buckets, token_buckets
from engine.graph_runner import DecodeGraphRunner, decode_in_place
from engine.graph_startup import capture_mixed_at_start
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.req_table import ReqTable
from engine.layers.moe import DEVICE_ROUTING_MAX_TOKENS, SparseMoE
from engine.mixed_graphs import MixedGraphRunner, mixed_blockers

logger = logging.getLogger(__name__)

# Set to 1: the graph path without a graph API (direct_graphs).
DIRECT_GRAPHS_ENV = "HISERVE_DIRECT_DECODE_GRAPHS"


def graph_blockers(model: torch.nn.Module, max_batch: int = 1) -> list[str]:
    """Why a decode step of ``model`` (up to ``max_batch`` rows) cannot be captured
    (empty: it can).

    Captured work must not read tensor values on the host nor take shapes from per-step
    Python values; windowed PyTorch attention loops over sequences with their own
    lengths, and MoE routing without the Triton kernels reads the chosen experts back to
    the host past DEVICE_ROUTING_MAX_TOKENS.
    """
    reasons: set[str] = set()
    for module in model.modules():
        backend = getattr(module, "attn_backend", None)
        if backend is not None and not getattr(backend, "graph_safe_decode", False):
            reasons.add(f"attention backend {backend.name!r} sizes its work per sequence")
        if (
            isinstance(module, SparseMoE)
            and module.fused_experts is None
            and max_batch > DEVICE_ROUTING_MAX_TOKENS
        ):
            reasons.add(
                f"mixture-of-experts routing reads the chosen experts on the host past "
                f"{DEVICE_ROUTING_MAX_TOKENS} tokens (--cuda-graph-max-bs to stay under it)"
            )
    return sorted(reasons)


class PoolAndTable(Protocol):
    """What the graphs read: rank 0's KVSetup, or a tensor-parallel worker's RankKV."""

    device_pool: DeviceKVPool
    req_table: ReqTable


# Ranks' values gathered on every rank, in rank order (engine/tp/protocol.py gather).
Gather = Callable[[Any], list[Any]]


def direct_graphs() -> bool:
    """Whether decode runs the graph path on a device without a graph API, each "replay"
    calling the captured function on the static buffers (``DIRECT_GRAPHS_ENV=1``): how
    CPU tests drive that path end to end, tensor-parallel workers (processes of their own)
    included. It gains nothing on a CPU."""
    return os.environ.get(DIRECT_GRAPHS_ENV, "0") == "1"


def _why_eager(
    config: EngineConfig, model: Any, api: platform.GraphApi | None, spec: platform.DeviceSpec
) -> tuple[str, int] | None:
    """Why this rank's decode stays eager, with the log level to say it at; None: it can
    be captured."""
    if config.disable_cuda_graph:
        return "off (--disable-cuda-graph)", logging.INFO
    if api is None and not direct_graphs():
        if spec.type == "cpu":
            return "off on the CPU", logging.DEBUG
        return f"{spec.type} has no graph API; decode runs eagerly", logging.INFO
    blockers = graph_blockers(model, _max_batch(config))
    if blockers:
        return f"off for this model ({'; '.join(blockers)}); decode runs eagerly", logging.WARNING
    if config.tensor_parallel_size > 1 and not decode_in_place(model):
        # NOTE: the gather fallback captures lazily while serving; ranks cannot agree on
        # a capture that fails midway on one of them.
        return (
            f"off under tensor parallelism (tp={config.tensor_parallel_size}) with an "
            "attention backend that gathers K/V; decode runs eagerly",
            logging.INFO,
        )
    return None


def _max_batch(config: EngineConfig) -> int:
    return min(config.cuda_graph_max_bs or config.max_running_requests, config.max_running_requests)


def build_decode_graphs(
    config: EngineConfig,
    model: Any,
    kv: PoolAndTable,
    spec: platform.DeviceSpec,
    device: torch.device,
    gather: Gather | None = None,
) -> DecodeGraphRunner | None:
    """The engine's decode graph runner, or None (logged) where decode stays eager:
    turned off, a device without graphs (cpu, mps, npu, xpu), a model with work that
    cannot be captured, or tensor parallelism with the gather fallback.

    Under tensor parallelism every rank calls this with ``gather`` (its values and the
    other ranks', on every rank): the ranks agree that all of them capture the same
    buckets, capture them in lockstep (largest first, each with the forward's
    all-reduces) and agree after each capture and each check, so either every rank
    replays graphs or none does.
    """
    tp = config.tensor_parallel_size > 1
    if tp and gather is None:
        raise ValueError("tensor-parallel ranks agree on decode graphs: pass gather")
    api = platform.graph_api(spec)
    eager = _why_eager(config, model, api, spec)
    buckets = batch_buckets(_max_batch(config)) if eager is None else None
    if tp:
        assert gather is not None
        views = gather(buckets)
        if eager is None and any(view != buckets for view in views):
            eager = (
                f"off: the tensor-parallel ranks would capture {views} batch sizes, not the "
                "same (a rank that cannot capture logs why); decode runs eagerly",
                logging.WARNING,
            )
    if eager is not None:
        reason, level = eager
        logger.log(level, "device graphs: %s", reason)
        return None
    runner = DecodeGraphRunner(
        model, kv.device_pool, kv.req_table, device, _max_batch(config), api=api, spec=spec
    )
    if runner.in_place:
        failure = graph_startup.capture_at_start(runner, gather=gather if tp else None)
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


def mixed_batches_on(config: EngineConfig, decode: DecodeGraphRunner | None) -> bool:
    """Whether steps mix decodes and prefill chunks: as asked, else (auto) where decode
    steps do not replay graphs (a graphed decode step beat an eager mixed one on an H200;
    docs/performance.md, "Mixed batches")."""
    if config.enable_mixed_batches is not None:
        return config.enable_mixed_batches
    return decode is None


def build_mixed_graphs(
    config: EngineConfig,
    model: Any,
    kv: PoolAndTable,
    decode: DecodeGraphRunner | None,
    spec: platform.DeviceSpec,
    device: torch.device,
    gather: Gather | None = None,
) -> MixedGraphRunner | None:
    """Graphs for the steps that prefill (alone or beside decodes), every token bucket up
    to the prefill budget captured and checked now; None (logged) where those steps stay
    eager: mixed batches off, decode graphs off or captured lazily, or a model whose
    extend cannot be captured.

    Every tensor-parallel rank calls this right after ``build_decode_graphs`` (whose
    outcome they share), with ``gather``: the ranks agree on the token sizes, capture in
    lockstep and stop together at the first failure of any, as for decode.
    """
    tp = config.tensor_parallel_size > 1
    if tp and gather is None:
        raise ValueError("tensor-parallel ranks agree on mixed graphs: pass gather")
    if decode is None or not decode.captured_at_start or not mixed_batches_on(config, decode):
        return None  # the same on every rank: decode graphs are agreed, the config shared
    max_tokens = config.max_prefill_tokens or default_max_prefill_tokens(device.type)
    why = "; ".join(graph_blockers(model, max_tokens) + mixed_blockers(model)) or None
    buckets = token_buckets(max_tokens) if why is None else None
    if tp:
        assert gather is not None
        views = gather(buckets)
        if why is None and any(view != buckets for view in views):
            why = f"the tensor-parallel ranks would capture {views} token sizes, not the same"
    if why is not None:
        logger.info("mixed graphs: off (%s); steps that prefill run eagerly", why)
        return None
    runner = MixedGraphRunner(
        model,
        kv.device_pool,
        kv.req_table,
        device,
        max_tokens,
        config.max_running_requests,
        api=decode.api,
        spec=spec,
        pool=decode.pool,
    )
    failure = capture_mixed_at_start(runner, gather=gather if tp else None)
    if failure is not None:
        logger.warning("mixed graphs: off, steps that prefill run eagerly: %s", failure)
        return None
    return runner
