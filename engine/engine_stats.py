"""What the engine reports about itself: running totals since start, the ``stats()``
snapshot that metrics and the fleet endpoints read, and one log line per prefill batch."""

from __future__ import annotations

import logging

from engine.cache_salt import SALT_BUCKETS, salt_bucket
from engine.kv_setup import KVSetup
from engine.kvcache.miss_reasons import MISS_REASONS
from engine.request import Req
from engine.scheduled_batch import ScheduledBatch
from engine.scheduler import Scheduler

logger = logging.getLogger("hiserve.engine")

ENGINE_COUNTERS = (
    "prompt_tokens_total",
    "generation_tokens_total",
    "cached_tokens_device_total",
    "cached_tokens_host_total",
    "cached_tokens_storage_total",
    "requests_finished_total",
    # prompt tokens that missed the cache, by reason (engine/kvcache/miss_reasons.py)
    *(f"prompt_tokens_missed_{reason}_total" for reason in MISS_REASONS),
)


def salt_counter(bucket: int, what: str) -> str:
    """The stats() key of a per-salt-bucket counter: ``what`` is "prompt" or "cached"."""
    return f"salt_bucket_{bucket}_{what}_tokens_total"


class EngineStats:
    """Counters the engine bumps as requests run, and the views of them it reports."""

    def __init__(self, scheduler: Scheduler, kv: KVSetup) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.counters: dict[str, int] = dict.fromkeys(ENGINE_COUNTERS, 0)
        # Salted requests only, by SALT_BUCKETS buckets of the salt's digest: a fixed
        # number of series however many tenants there are (never the salt itself).
        for bucket in range(SALT_BUCKETS):
            self.counters[salt_counter(bucket, "prompt")] = 0
            self.counters[salt_counter(bucket, "cached")] = 0

    def count_prompt(self, req: Req) -> None:
        """Once per request, at its first output token: its prompt, by where it came from."""
        self.counters["prompt_tokens_total"] += len(req.prompt_ids)
        self.counters["cached_tokens_device_total"] += req.cached_device
        self.counters["cached_tokens_host_total"] += req.cached_host
        self.counters["cached_tokens_storage_total"] += req.cached_storage
        for reason, tokens in req.miss_reasons.as_dict().items():
            self.counters[f"prompt_tokens_missed_{reason}_total"] += tokens
        if req.cache_salt:
            bucket = salt_bucket(req.cache_salt)
            self.counters[salt_counter(bucket, "prompt")] += len(req.prompt_ids)
            cached = req.cached_device + req.cached_host + req.cached_storage
            self.counters[salt_counter(bucket, "cached")] += cached

    def snapshot(self) -> dict[str, float]:
        """KV use per tier, queue lengths and every counter, as ``Engine.stats()`` returns."""
        manager = self.kv.manager
        running = self.scheduler.running
        stats: dict[str, float] = {
            "kv_total": manager.capacity,
            "kv_free": manager.allocator.free_tokens,
            "kv_used": sum(manager.owned_tokens(r) for r in running),
            "kv_cached": manager.tree.cached_tokens,
            # cached tokens locked by running requests (a subset of kv_cached)
            "kv_protected": manager.tree.protected_tokens,
            "running": len(running),
            "waiting": len(self.scheduler.waiting),
            "retractions_total": self.scheduler.num_retractions,
            "share_preemptions_total": self.scheduler.num_share_preemptions,
            "reader_pauses_total": self.scheduler.num_reader_pauses,
            "mixed_steps_total": self.scheduler.num_mixed_steps,
            "evicted_device_tokens_total": manager.tree.evicted_device_tokens,
        }
        stats.update(self.counters)
        stats.update(self.kv.host_stats())
        return stats

    def log_prefill(self, batch: ScheduledBatch, seconds: float) -> None:
        """One INFO line for a batch with prefill work that took ``seconds``."""
        if not logger.isEnabledFor(logging.INFO):
            return
        prefills = batch.prefill_reqs
        logger.info(
            "prefill batch: %d reqs, %d new tokens, cached %d device / %d host / %d storage, "
            "%d decodes mixed in, running %d, waiting %d, %.0f tok/s",
            len(prefills),
            batch.num_prefill_tokens,
            sum(r.cached_device for r in prefills),
            sum(r.cached_host for r in prefills),
            sum(r.cached_storage for r in prefills),
            batch.num_decodes,
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            batch.num_tokens / max(seconds, 1e-9),
        )
