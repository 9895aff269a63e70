"""Where each prompt token came from: hits by tier, misses by reason (rows and a bar).

Every prompt token the server counted is a hit on one tier (device, host, storage) or a
miss for one reason (hiserve's ``prompt_tokens_details.cache_miss_reasons``; see
docs/api.md), so one run's outcomes add up to its prompt tokens and fill one bar.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.stats import MISS_REASONS, TIERS

# (key in the report, label): hits by tier first, then misses by reason.
HIT_LABELS = {"device": "hit: device", "host": "hit: host", "storage": "hit: storage"}
MISS_LABELS = {
    "never_seen": "miss: never seen",
    "evicted": "miss: evicted",
    "below_page": "miss: below page",
    "not_loaded": "miss: not loaded (host)",
    "storage_timeout": "miss: storage timeout",
    "not_routed": "miss: not routed",
}
# Hits in greens and blues, misses in warm colours and greys.
COLOURS = {
    "device": "#1b7837",
    "host": "#5aae61",
    "storage": "#2166ac",
    "never_seen": "#bababa",
    "evicted": "#d6604d",
    "below_page": "#878787",
    "not_loaded": "#f4a582",
    "storage_timeout": "#b2182b",
    "not_routed": "#8073ac",
}


def outcomes(report: dict[str, Any]) -> dict[str, int | None]:
    """Prompt tokens per outcome (tiers, then reasons); None where the server did not
    report that figure for every request."""
    found: dict[str, int | None] = {
        tier: report.get(f"total_cached_tokens_{tier}") for tier in TIERS
    }
    reasons = report.get("cache_miss_reasons")
    for reason in MISS_REASONS:
        found[reason] = None if reasons is None else int(reasons.get(reason, 0))
    return found


def _share(tokens: int | None, whole: int) -> str:
    if tokens is None or not whole:
        return "-"
    return f"{100.0 * tokens / whole:.1f}% ({tokens})"


def outcome_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """Table rows: each tier's hits and each reason's misses, as a share of the prompt
    tokens (and the tokens); the same rows for every report, "-" where not reported."""
    whole = int(report.get("total_prompt_tokens") or 0)
    found = outcomes(report)
    rows = [("Prompt tokens: hits by tier, misses by reason", str(whole) if whole else "-")]
    labels = {**HIT_LABELS, **MISS_LABELS}
    rows += [(f"  {labels[key]}", _share(tokens, whole)) for key, tokens in found.items()]
    return rows


def plot_outcomes(axes: Any, reports: Sequence[dict[str, Any]]) -> None:
    """One stacked bar per report: the share of its prompt tokens per outcome."""
    names = [str(r["label"]) for r in reports]
    bottoms = [0.0] * len(reports)
    labels = {**HIT_LABELS, **MISS_LABELS}
    for key in (*TIERS, *MISS_REASONS):
        heights = []
        for report in reports:
            whole = report.get("total_prompt_tokens") or 0
            tokens = outcomes(report)[key]
            heights.append(100.0 * tokens / whole if tokens and whole else 0.0)
        if not any(heights):
            continue  # an outcome no run had: no legend entry either
        axes.bar(names, heights, bottom=bottoms, label=labels[key], color=COLOURS[key])
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    axes.set(title="Prompt tokens by outcome", ylabel="share of prompt tokens (%)", ylim=(0, 100))
