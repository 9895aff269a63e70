"""What-if curves: replay one trace at a grid of tier sizes, in parallel processes.

Three curves, each a sweep of one tier with the tiers above it fixed:
- ``device``: device pool sizes, no host tier (hit rate of the radix cache alone);
- ``host``: host tier sizes under the given device pool (device + host hits);
- ``storage``: L3 sizes under the given device pool and host tier (all hits).
A curve's *miss ratio* is 1 - the hits of its tier and those above, over prompt tokens.
For each curve the report names the smallest size that reaches 90 / 95 / 99% of the
hit rate of an infinite cache (every page ever computed kept).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from bench.whatif_sim import SimConfig, SimResult, ideal_hits, replay
from engine.cache_trace import TraceRecord

CURVES = ("device", "host", "storage")
LEVELS = (0.90, 0.95, 0.99)

# The trace a worker replays: set before the pool forks, so it is not pickled per task.
_RECORDS: list[TraceRecord] = []


@dataclass(frozen=True)
class CurvePoint:
    size_tokens: int
    device_rate: float
    host_rate: float
    storage_rate: float

    def hit_rate(self, curve: str) -> float:
        """The hits a ``curve`` counts: its tier and every tier above it."""
        rates = {"device": self.device_rate, "host": self.host_rate, "storage": self.storage_rate}
        return sum(rates[tier] for tier in CURVES[: CURVES.index(curve) + 1])


def footprint_tokens(records: Sequence[TraceRecord], page_size: int) -> int:
    """Tokens of every distinct whole page the trace computes (an infinite cache's size)."""
    pages: set[int] = set()
    fresh = 0
    for record in records:
        kv_len = record.prompt_len + max(record.output_len - 1, 0)
        whole = kv_len // page_size
        pages.update(record.pages[:whole])
        fresh += max(whole - len(record.pages), 0)  # output pages with no hash: all new
    return (len(pages) + fresh) * page_size


def size_grid(low: int, high: int, points: int, page_size: int) -> list[int]:
    """``points`` sizes spaced geometrically over [low, high], whole pages, distinct."""
    low = max(low, page_size)
    high = max(high, low)
    if points <= 1:
        return [high - high % page_size]
    sizes = []
    for i in range(points):
        size = low * (high / low) ** (i / (points - 1))
        sizes.append(max(page_size, round(size / page_size) * page_size))
    return sorted(set(sizes))


def _replay_point(config: SimConfig) -> SimResult:
    result = replay(_RECORDS, config)
    result.per_request = []  # not needed by the curves; keep the pipe small
    return result


def run_grid(
    records: list[TraceRecord], configs: Sequence[SimConfig], jobs: int
) -> list[SimResult]:
    """Replay ``records`` at every config, over ``jobs`` forked processes (1: in-line)."""
    global _RECORDS
    _RECORDS = records
    try:
        if jobs <= 1 or len(configs) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
            return [_replay_point(c) for c in configs]
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            return list(pool.map(_replay_point, configs))
    finally:
        _RECORDS = []


def default_jobs() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


@dataclass(frozen=True)
class GridSpec:
    """What to sweep: the fixed sizes of the tiers above each curve, and the curves."""

    base: SimConfig  # device_tokens, host_tokens, storage_tokens at the server's sizes
    curves: tuple[str, ...] = ("device", "host")
    points: int = 20


def curve_configs(spec: GridSpec, footprint: int) -> dict[str, list[SimConfig]]:
    """The configs of every curve. Device sizes run from one page to the trace's
    footprint; a host tier holds copies of the device's pages (write-through) and L3 of
    the host's, so their sweeps start at the size of the tier above."""
    base, page = spec.base, spec.base.page_size
    host = base.host_tokens or base.device_tokens
    configs: dict[str, list[SimConfig]] = {}
    for curve in spec.curves:
        if curve == "device":
            sizes = size_grid(page, footprint, spec.points, page)
            configs[curve] = [
                replace(base, device_tokens=s, host_tokens=0, storage_tokens=0) for s in sizes
            ]
        elif curve == "host":
            sizes = size_grid(base.device_tokens, footprint, spec.points, page)
            configs[curve] = [replace(base, host_tokens=s, storage_tokens=0) for s in sizes]
        else:
            sizes = size_grid(host, footprint, spec.points, page)
            configs[curve] = [replace(base, host_tokens=host, storage_tokens=s) for s in sizes]
    return configs


def what_if(records: list[TraceRecord], spec: GridSpec, jobs: int) -> dict[str, Any]:
    """Every curve, the infinite-cache hit rate and the sizes that reach its levels."""
    page = spec.base.page_size
    prompt_tokens = sum(r.prompt_len for r in records)
    ideal = ideal_hits(records, page) / max(prompt_tokens, 1)
    footprint = footprint_tokens(records, page)
    configs = curve_configs(spec, footprint)
    flat = [c for curve in configs.values() for c in curve]
    results = iter(run_grid(records, flat, jobs))
    curves: dict[str, Any] = {}
    for curve, sweep in configs.items():
        points = []
        for config in sweep:
            result = next(results)
            size = {"device": config.device_tokens, "host": config.host_tokens}.get(
                curve, config.storage_tokens
            )
            points.append(
                CurvePoint(size, result.rate("device"), result.rate("host"), result.rate("storage"))
            )
        curves[curve] = {
            "points": [p.__dict__ for p in points],
            "reach": {
                f"{int(level * 100)}%": _smallest_reaching(points, curve, level * ideal)
                for level in LEVELS
            },
        }
    return {
        "requests": len(records),
        "prompt_tokens": prompt_tokens,
        "page_size": page,
        "footprint_tokens": footprint,
        "ideal_hit_rate": ideal,
        "base": spec.base.__dict__,
        "curves": curves,
    }


def _smallest_reaching(points: list[CurvePoint], curve: str, target: float) -> int | None:
    for point in points:
        if point.hit_rate(curve) >= target - 1e-12:
            return point.size_tokens
    return None


def format_report(report: dict[str, Any]) -> str:
    """A plain-text table per curve and the sizes reaching 90/95/99% of ideal."""
    lines = [
        f"{report['requests']} requests, {report['prompt_tokens']} prompt tokens, page size "
        f"{report['page_size']}; infinite-cache hit rate {report['ideal_hit_rate']:.1%} "
        f"(footprint {report['footprint_tokens']} tokens)"
    ]
    base = report["base"]
    fixed = {
        "device": "no host tier",
        "host": f"device {base['device_tokens']} tokens",
        "storage": f"device {base['device_tokens']}, host {base['host_tokens'] or base['device_tokens']} tokens",
    }
    for curve, data in report["curves"].items():
        lines.append(f"\n{curve} tier sweep ({fixed[curve]}):")
        lines.append(f"  {'size (tokens)':>14} {'device':>7} {'host':>7} {'L3':>7} {'miss':>7}")
        for p in data["points"]:
            point = CurvePoint(**p)
            miss = 1.0 - point.hit_rate(curve)
            lines.append(
                f"  {point.size_tokens:>14} {point.device_rate:>7.1%} {point.host_rate:>7.1%} "
                f"{point.storage_rate:>7.1%} {miss:>7.1%}"
            )
        reach = ", ".join(
            f"{level} of ideal: {size if size is not None else 'not reached'}"
            for level, size in data["reach"].items()
        )
        lines.append(f"  smallest {curve} size reaching {reach}")
    return "\n".join(lines)


def write_plot(path: str, report: dict[str, Any]) -> None:
    """Miss ratio against tier size (log scale), one panel per curve."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    curves = report["curves"]
    fig = Figure(figsize=(5.5 * max(len(curves), 1), 4.2))
    FigureCanvasAgg(fig)
    ideal_miss = 1.0 - report["ideal_hit_rate"]
    for i, (curve, data) in enumerate(curves.items()):
        ax = fig.add_subplot(1, max(len(curves), 1), i + 1)
        points = [CurvePoint(**p) for p in data["points"]]
        sizes = [p.size_tokens for p in points]
        ax.plot(sizes, [1.0 - p.hit_rate(curve) for p in points], marker="o", label="miss ratio")
        ax.axhline(ideal_miss, color="gray", linestyle="--", label="infinite cache")
        for level, size in data["reach"].items():
            if size is not None:
                ax.axvline(size, linestyle=":", linewidth=1, color="tab:red")
                ax.annotate(level, (size, 0.98), fontsize=7, rotation=90, va="top")
        ax.set_xscale("log")
        ax.set_ylim(0.0, 1.0)
        ax.set_xlabel(f"{curve} tier size (tokens)")
        ax.set_ylabel("miss ratio (prompt tokens)")
        ax.set_title(f"{curve} tier")
        ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
