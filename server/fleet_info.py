"""What a router in front of many replicas asks a replica: its load and what it serves.

The SGLang Model Gateway (``smg``) polls ``GET /v1/loads`` for its load-aware policies
(``power_of_two``, ``least_load``, and the KV-usage gate of ``cache_aware``), and reads
``/server_info`` and ``/model_info`` when it registers a worker. These routes only read
the numbers the engine loop already publishes; they never touch engine state.

All three are admin routes (``server.middleware.ADMIN_PATHS``): with ``--admin-key`` set
only that key opens them, else the client key does. ``/server_info`` and ``/model_info``
name the model path and the device; the router sends its key on every probe (smg's
``--api-key`` is the replicas' admin key).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Protocol

from fastapi import APIRouter, FastAPI

SERVER_VERSION = "0.1.0"


class FleetState(Protocol):
    """The part of the app's shared state these routes read."""

    engine: Any
    args: Any

    def require_client(self) -> Any: ...


def load_snapshot(stats: dict[str, float]) -> dict[str, Any]:
    """One data-parallel rank's load in the shape ``smg`` polls from ``/v1/loads``.

    ``num_used_tokens`` counts the device KV that running requests hold: their own slots
    plus the prefix-cache slots they lock. Cached KV that nobody uses is free to evict,
    so it does not count as load (as in SGLang).
    """
    total = int(stats.get("kv_total", 0))
    used = int(stats.get("kv_used", 0)) + int(stats.get("kv_protected", 0))
    return {
        "dp_rank": 0,
        "num_running_reqs": int(stats.get("running", 0)),
        "num_waiting_reqs": int(stats.get("waiting", 0)),
        "num_used_tokens": used,
        "max_total_num_tokens": total,
        "token_usage": min(1.0, used / total) if total else 0.0,
    }


def loads_body(stats: dict[str, float], now: datetime | None = None) -> dict[str, Any]:
    stamp = (now or datetime.now(timezone.utc)).isoformat()
    return {"timestamp": stamp, "dp_rank_count": 1, "loads": [load_snapshot(stats)]}


def server_info_body(state: FleetState) -> dict[str, Any]:
    """Identity and cache configuration of this replica (what ``smg`` labels it with)."""
    engine = state.engine
    config = state.args.engine
    health = engine.health()
    return {
        "served_model_name": engine.served_model_name,
        "model_path": str(engine.model_path),
        "version": SERVER_VERSION,
        "device": health.get("device"),
        "dtype": health.get("dtype"),
        "weights": health.get("weights"),
        "context_length": engine.max_model_len,
        "max_total_tokens": health.get("kv_total_tokens"),
        "max_running_requests": config.max_running_requests,
        "tp_size": 1,
        "dp_size": 1,
        "is_embedding": False,
        "cache": {
            "page_size": config.page_size,
            "kv_total_tokens": health.get("kv_total_tokens"),
            "enable_prefix_cache": config.enable_prefix_cache,
            "enable_hierarchical_cache": config.enable_hierarchical_cache,
            "hicache_write_policy": config.hicache_write_policy,
            "hicache_mem_layout": config.hicache_mem_layout,
            "host_total_tokens": health.get("host_total_tokens"),
            "host_alloc_method": health.get("host_alloc_method"),
            "pinned": health.get("pinned"),
        },
    }


def model_info_body(state: FleetState) -> dict[str, Any]:
    engine = state.engine
    return {
        "model_path": str(engine.model_path),
        "tokenizer_path": str(engine.model_path),
        "served_model_name": engine.served_model_name,
        "is_generation": True,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "max_model_len": engine.max_model_len,
    }


def add_fleet_routes(app: FastAPI, state: FleetState) -> None:
    """Add ``/v1/loads``, ``/server_info`` and ``/model_info`` to ``app``."""
    router = APIRouter()

    @router.get("/v1/loads")
    async def loads() -> dict[str, Any]:
        # ``include=`` (smg asks for core,disagg,queues,memory) is accepted and ignored:
        # a single-rank replica has only the core section.
        state.require_client()
        return loads_body(state.engine.stats())

    @router.get("/server_info")
    async def server_info() -> dict[str, Any]:
        state.require_client()
        return server_info_body(state)

    @router.get("/model_info")
    async def model_info() -> dict[str, Any]:
        state.require_client()
        return model_info_body(state)

    app.include_router(router)
