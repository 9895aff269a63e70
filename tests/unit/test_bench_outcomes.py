"""The load tool's hits-by-tier and misses-by-reason report, on canned results.

Two canned configurations ("radix" and "hicache") whose per-request numbers are written
out by hand; the table, the JSON totals and the stacked bar are checked against sums
of those numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.client import RequestResult, _apply_usage
from bench.outcomes import outcome_rows, outcomes, plot_outcomes
from bench.report import format_table, write_plot
from bench.stats import MISS_REASONS, hit_rates

STATS = dict.fromkeys(("mean", "p50", "p90", "p99"))


def result(index: int, prompt: int, tiers: tuple[int, int, int], **missed: int) -> RequestResult:
    """A completed request as the client parses it from hiserve's usage."""
    device, host, storage = tiers
    reasons = {**dict.fromkeys(MISS_REASONS, 0), **missed}
    assert device + host + storage + sum(reasons.values()) == prompt
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": 4,
        "prompt_tokens_details": {
            "cached_tokens": device + host + storage,
            "cached_tokens_device": device,
            "cached_tokens_host": host,
            "cached_tokens_storage": storage,
            "cache_miss_reasons": reasons,
        },
    }
    parsed = RequestResult(index=index, conversation=0, round=index, prompt_len=prompt, ok=True)
    _apply_usage(parsed, usage)
    return parsed


RADIX = [
    result(0, 100, (0, 0, 0), never_seen=99, below_page=1),
    result(1, 150, (20, 0, 0), evicted=80, never_seen=49, below_page=1),
]
HICACHE = [
    result(0, 100, (0, 0, 0), never_seen=99, below_page=1),
    result(1, 150, (20, 70, 0), not_loaded=10, never_seen=49, below_page=1),
]


def report(label: str, results: list[RequestResult]) -> dict[str, Any]:
    ideal = [0] * len(results)
    return {
        "label": label, "base_url": "http://h", "completed": len(results), "failed": 0,
        "not_sent": 0, "duration": 1.0, "request_throughput": 2.0, "input_throughput": 250.0,
        "output_throughput": 8.0, "rounds": [], "ttft": STATS, "itl": STATS,
        "e2e_latency": STATS, "workload": {"workload": "multiturn"}, "requests": [],
        **hit_rates(results, ideal),
    }  # fmt: skip


def test_totals_add_up_per_tier_and_reason() -> None:
    radix, hicache = report("radix", RADIX), report("hicache", HICACHE)
    assert radix["cache_miss_reasons"] == {
        **dict.fromkeys(MISS_REASONS, 0), "never_seen": 148, "evicted": 80, "below_page": 2,
    }  # fmt: skip
    assert hicache["total_cached_tokens_host"] == 70
    assert hicache["cache_miss_reasons"]["not_loaded"] == 10
    for rep in (radix, hicache):
        found = outcomes(rep)
        assert sum(v or 0 for v in found.values()) == rep["total_prompt_tokens"] == 250


def test_the_table_shows_both_configurations_side_by_side() -> None:
    table = format_table([report("radix", RADIX), report("hicache", HICACHE)])
    lines = {line.strip().split("  ")[0]: line.split() for line in table.splitlines()}
    assert lines["Metric"][1:] == ["radix", "hicache"]
    # Each cell: share of the 250 prompt tokens, then the tokens.
    assert lines["hit: host"][-4:] == ["0.0%", "(0)", "28.0%", "(70)"]
    assert lines["miss: evicted"][-4:] == ["32.0%", "(80)", "0.0%", "(0)"]
    assert lines["miss: never seen"][-4:] == ["59.2%", "(148)", "59.2%", "(148)"]
    assert lines["miss: not loaded (host)"][-4:] == ["0.0%", "(0)", "4.0%", "(10)"]


def test_a_server_without_reasons_shows_dashes() -> None:
    plain = [result(0, 100, (10, 0, 0), never_seen=89, below_page=1)]
    plain[0].cache_miss_reasons = None  # another server: no reasons in its usage
    rows = dict(outcome_rows(report("other", plain)))
    assert rows["  miss: evicted"] == "-" and rows["  hit: device"] == "10.0% (10)"


def test_the_stacked_bar_fills_each_run(tmp_path: Path) -> None:
    from matplotlib.figure import Figure

    reports = [report("radix", RADIX), report("hicache", HICACHE)]
    axes = Figure().subplots()
    plot_outcomes(axes, reports)
    for index, rep in enumerate(reports):
        bars = [c.patches[index] for c in axes.containers]
        assert sum(bar.get_height() for bar in bars) == pytest.approx(100.0)  # every token
        by_label = {c.get_label(): c.patches[index].get_height() for c in axes.containers}
        never_seen = rep["cache_miss_reasons"]["never_seen"]
        assert by_label["miss: never seen"] == 100.0 * never_seen / rep["total_prompt_tokens"]
    labels = [c.get_label() for c in axes.containers]
    assert "hit: storage" not in labels  # no run had any: no empty legend entry
    png = tmp_path / "c.png"
    write_plot(png, reports)
    assert png.read_bytes()[:4] == b"\x89PNG"
