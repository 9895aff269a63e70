"""Percentiles and the summary numbers of a run (throughput, latency, hit rates)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from bench.client import RequestResult
from engine.kvcache.miss_reasons import MISS_REASONS  # torch-free, in report order

PERCENTILES = (50, 90, 99)
TIERS = ("device", "host", "storage")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks.

    Same definition as numpy's default ("linear"): position ``q/100 * (n - 1)`` in the
    sorted values, interpolated between its two neighbours.
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    position = q / 100.0 * (len(ordered) - 1)
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    fraction = position - lower
    return ordered[lower] + (ordered[upper] - ordered[lower]) * fraction


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """``mean``, ``p50``, ``p90``, ``p99`` of ``values``; all None when there are none."""
    summary: dict[str, float | None] = {"mean": sum(values) / len(values) if values else None}
    for q in PERCENTILES:
        summary[f"p{q}"] = percentile(values, q) if values else None
    return summary


def _rate(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def _tier_total(results: Sequence[RequestResult], tier: str) -> int | None:
    values = [getattr(r, f"cached_tokens_{tier}") for r in results]
    if not values or any(v is None for v in values):
        return None  # the server does not report this tier (for every request)
    return sum(v for v in values if v is not None)


def miss_totals(results: Sequence[RequestResult]) -> dict[str, int] | None:
    """Uncached prompt tokens by reason over ``results``; None unless every result has
    them (a server that does not report reasons, or hides them, gives none)."""
    if not results or any(r.cache_miss_reasons is None for r in results):
        return None
    totals = dict.fromkeys(MISS_REASONS, 0)
    for result in results:
        assert result.cache_miss_reasons is not None
        for reason, tokens in result.cache_miss_reasons.items():
            totals[reason] = totals.get(reason, 0) + tokens
    return totals


def hit_rates(results: Sequence[RequestResult], ideal_per_request: Sequence[int]) -> dict[str, Any]:
    """Achieved and ideal cache-hit rates of completed ``results``.

    ``ideal_per_request[i]`` is what an unbounded cache would serve for ``results[i]``
    (see ``workloads.ideal_cached_tokens``). The achieved rate divides by the prompt
    tokens the server counted, the ideal one by the tokens the client sent.
    """
    prompt_tokens = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens or 0 for r in results)
    ideal = sum(ideal_per_request)
    tiers = {tier: _tier_total(results, tier) for tier in TIERS}
    return {
        "cache_hit_rate": _rate(cached, prompt_tokens),
        "ideal_hit_rate": _rate(ideal, sum(r.prompt_len for r in results)),
        **{
            f"{tier}_hit_rate": _rate(total, prompt_tokens) if total is not None else None
            for tier, total in tiers.items()
        },
        "total_prompt_tokens": prompt_tokens,
        "total_cached_tokens": cached,
        **{f"total_cached_tokens_{tier}": total for tier, total in tiers.items()},
        "ideal_cached_tokens": ideal,
        "cached_tokens_reported": all(r.cached_tokens is not None for r in results),
        # prompt tokens no tier served, by reason (None: not reported for every request)
        "cache_miss_reasons": miss_totals(results),
    }


def per_round(
    results: Sequence[RequestResult], ideal_per_request: Sequence[int]
) -> list[dict[str, Any]]:
    """Hit rates and TTFT per conversation round (multiturn), rounds in ascending order."""
    rounds: dict[int, list[tuple[RequestResult, int]]] = {}
    for result, ideal in zip(results, ideal_per_request, strict=True):
        rounds.setdefault(result.round, []).append((result, ideal))
    table = []
    for round_idx in sorted(rounds):
        members = rounds[round_idx]
        prompt_tokens = sum(r.prompt_tokens for r, _ in members)
        ttfts = [r.ttft for r, _ in members if r.ttft is not None]
        table.append(
            {
                "round": round_idx,
                "requests": len(members),
                "prompt_tokens": prompt_tokens,
                "cache_hit_rate": _rate(
                    sum(r.cached_tokens or 0 for r, _ in members), prompt_tokens
                ),
                "ideal_hit_rate": _rate(
                    sum(i for _, i in members), sum(r.prompt_len for r, _ in members)
                ),
                "ttft_mean": sum(ttfts) / len(ttfts) if ttfts else None,
            }
        )
    return table
