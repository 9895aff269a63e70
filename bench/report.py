"""Turns measured runs into a summary dict, a table on stdout, a JSON file and a plot."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.client import RequestResult
from bench.outcomes import outcome_rows, plot_outcomes
from bench.runner import RunOptions, RunState
from bench.stats import hit_rates, per_round, summarize
from bench.workloads import Workload, ideal_cached_tokens


def build_report(state: RunState, workload: Workload, options: RunOptions) -> dict[str, Any]:
    """Summary of one run; complete or partial (then ``aborted`` says why)."""
    in_order = state.results_in_dispatch_order()
    completed = [r for r in in_order if r.ok]
    failed = [r for r in in_order if not r.ok]
    prompts = {r.index: r.prompt for r in workload.requests}
    ideal = ideal_cached_tokens([prompts[r.index] for r in completed])
    if workload.config.prompt_mode == "text":
        completed, ideal = in_server_tokens(completed, ideal)
    duration = state.duration
    input_tokens = sum(r.prompt_tokens for r in completed)
    output_tokens = sum(r.output_tokens for r in completed)
    tpots = [
        (r.e2e_latency - r.ttft) / (r.output_tokens - 1)
        for r in completed
        if r.e2e_latency is not None and r.ttft is not None and r.output_tokens > 1
    ]
    errors = Counter((r.error_kind or "unknown", r.error or "") for r in failed)

    def per_second(amount: float) -> float | None:
        return amount / duration if duration > 0 else None

    report: dict[str, Any] = {
        "label": state.label,
        "base_url": state.base_url,
        "model": state.model,
        "workload": workload.config.to_dict(),
        "request_rate": options.request_rate,
        "max_concurrency": options.max_concurrency,
        "cache_flushed": state.cache_flushed,
        "total_requests": state.total_requests,
        "completed": len(completed),
        "failed": len(failed),
        "not_sent": state.not_sent,
        "aborted": state.aborted,
        "errors": [
            {"kind": kind, "message": message, "count": count}
            for (kind, message), count in errors.most_common()
        ],
        "duration": duration,
        "request_throughput": per_second(len(completed)),
        "input_throughput": per_second(input_tokens),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
        "total_output_tokens": output_tokens,
        **hit_rates(completed, ideal),
        "workload_ideal_hit_rate": workload.ideal_hit_rate(),
        "ttft": summarize([r.ttft for r in completed if r.ttft is not None]),
        "itl": summarize([gap for r in completed for gap in r.itl]),
        "tpot": summarize(tpots),
        "e2e_latency": summarize([r.e2e_latency for r in completed if r.e2e_latency is not None]),
        "rounds": per_round(completed, ideal),
        "workers": dict(sorted(Counter(r.worker for r in completed if r.worker).items())),
        "requests": [_request_row(r) for r in in_order],
    }
    return report


def in_server_tokens(
    results: Sequence[RequestResult], ideal_words: Sequence[int]
) -> tuple[list[RequestResult], list[int]]:
    """Text mode: the ideal counted in the server's tokens instead of words.

    A text prompt shares a prefix of whole words with an earlier one; its ideal cached
    tokens are that share of the prompt tokens the server reported (``usage``), and the
    prompt length becomes the server's count. Exact when every word is the same number
    of tokens wherever it stands, which holds for the space-separated common words the
    text mode uses, up to a token at the boundary.
    """
    scaled, ideal = [], []
    for result, words in zip(results, ideal_words, strict=True):
        share = words / result.prompt_len if result.prompt_len else 0.0
        tokens = result.prompt_tokens
        ideal.append(min(round(share * tokens), max(tokens - 1, 0)))
        scaled.append(replace(result, prompt_len=tokens))
    return scaled, ideal


def _request_row(result: Any) -> dict[str, Any]:
    return {
        "index": result.index,
        "conversation": result.conversation,
        "round": result.round,
        "ok": result.ok,
        "error": result.error,
        "retries": result.retries,
        "ttft": result.ttft,
        "e2e_latency": result.e2e_latency,
        "prompt_tokens": result.prompt_tokens,
        "output_tokens": result.output_tokens,
        "cached_tokens": result.cached_tokens,
        "cached_tokens_device": result.cached_tokens_device,
        "cached_tokens_host": result.cached_tokens_host,
        "cached_tokens_storage": result.cached_tokens_storage,
        "cache_miss_reasons": result.cache_miss_reasons,
        "worker": result.worker,
    }


def _json_safe(value: Any) -> Any:
    """inf/nan have no JSON spelling: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: str | os.PathLike[str], payload: dict[str, Any]) -> None:
    """Write ``payload`` (creating parent folders); replaced in one step, never half-written."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.with_name(target.name + ".tmp")
    scratch.write_text(json.dumps(_json_safe(payload), indent=2, allow_nan=False) + "\n")
    scratch.replace(target)


def _fmt(value: Any, scale: float = 1.0, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float | int) and not isinstance(value, bool):
        return f"{value * scale:.{digits}f}"
    return str(value)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.1f}%"


def _ratio(report: dict[str, Any]) -> str:
    achieved, ideal = report.get("cache_hit_rate"), report.get("ideal_hit_rate")
    if achieved is None or not ideal:
        return "-"
    return f"{achieved / ideal:.2f}"


def _rows(report: dict[str, Any], rounds: int, workers_row: bool) -> list[tuple[str, str]]:
    rows = [
        ("Target", str(report["base_url"])),
        (
            "Requests ok / failed / not sent",
            f"{report['completed']} / {report['failed']} / {report['not_sent']}",
        ),
        ("Duration (s)", _fmt(report["duration"])),
        ("Request throughput (req/s)", _fmt(report["request_throughput"])),
        ("Input throughput (tok/s)", _fmt(report["input_throughput"], digits=1)),
        ("Output throughput (tok/s)", _fmt(report["output_throughput"], digits=1)),
        ("Cache hit rate", _pct(report["cache_hit_rate"])),
        (
            "  from device / host",
            f"{_pct(report['device_hit_rate'])} / {_pct(report['host_hit_rate'])}",
        ),
        ("Ideal hit rate (unbounded cache)", _pct(report["ideal_hit_rate"])),
        ("Achieved / ideal", _ratio(report)),
        *outcome_rows(report),
    ]
    for name, key, scale, unit in (
        ("TTFT", "ttft", 1e3, "ms"),
        ("ITL", "itl", 1e3, "ms"),
        ("E2E latency", "e2e_latency", 1.0, "s"),
    ):
        stats = report[key]
        for stat in ("mean", "p50", "p90", "p99"):
            digits = 2 if unit == "ms" else 3
            rows.append((f"{name} {stat} ({unit})", _fmt(stats[stat], scale, digits)))
    if workers_row:  # behind a router: how it spread the requests over the replicas
        workers = report.get("workers") or {}
        counts = " / ".join(str(n) for n in workers.values()) or "-"
        rows.append(("Requests per replica", counts))
    by_round = {row["round"]: row for row in report["rounds"]}
    if rounds > 1:
        for r in range(rounds):
            row = by_round.get(r)
            value = (
                "-"
                if row is None
                else (f"{_pct(row['cache_hit_rate'])} / {_pct(row['ideal_hit_rate'])}")
            )
            rows.append((f"Round {r} hit rate (achieved / ideal)", value))
    return rows


def format_table(reports: Sequence[dict[str, Any]]) -> str:
    """One column per report, one row per metric; a single run is a one-column table."""
    rounds = max((len(r["rounds"]) for r in reports), default=0)
    workers_row = any(r.get("workers") for r in reports)
    columns = [_rows(r, rounds, workers_row) for r in reports]
    names = [name for name, _ in columns[0]] if columns else []
    header = ["Metric", *(str(r["label"]) for r in reports)]
    body = [[name, *(col[i][1] for col in columns)] for i, name in enumerate(names)]
    widths = [max(len(row[c]) for row in [header, *body]) for c in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))])

    rule = "-" * (sum(widths) + 2 * (len(widths) - 1))
    workload = reports[0]["workload"]["workload"] if reports else ""
    title = f"hiserve-bench: {workload}"
    return "\n".join([title, rule, line(header), rule, *(line(r) for r in body), rule])


def write_plot(path: str | os.PathLike[str], reports: Sequence[dict[str, Any]]) -> None:
    """PNG with the hit rate per round (achieved vs ideal), the TTFT distribution, and a
    stacked bar per run of its prompt tokens by outcome (hits by tier, misses by reason)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(16, 4.6), dpi=110)
    FigureCanvasAgg(figure)
    hit_axes, ttft_axes, outcome_axes = figure.subplots(1, 3)
    for report in reports:
        rounds = report["rounds"]
        xs = [row["round"] for row in rounds]
        hit_axes.plot(
            xs,
            [100 * (row["cache_hit_rate"] or 0.0) for row in rounds],
            marker="o",
            label=str(report["label"]),
        )
        ttfts = sorted(1e3 * row["ttft"] for row in report["requests"] if row["ttft"] is not None)
        if ttfts:
            fractions = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
            ttft_axes.step(ttfts, fractions, where="post", label=str(report["label"]))
    if reports and reports[0]["rounds"]:
        rounds = reports[0]["rounds"]
        hit_axes.plot(
            [row["round"] for row in rounds],
            [100 * (row["ideal_hit_rate"] or 0.0) for row in rounds],
            linestyle="--",
            color="gray",
            label="ideal (unbounded cache)",
            zorder=3,
        )
    hit_axes.set(
        title="Cache hit rate per round", xlabel="round", ylabel="hit rate (%)", ylim=(0, 100)
    )
    hit_axes.xaxis.get_major_locator().set_params(integer=True)
    ttft_axes.set(
        title="TTFT distribution", xlabel="TTFT (ms)", ylabel="fraction of requests", ylim=(0, 1.02)
    )
    plot_outcomes(outcome_axes, reports)
    for axes in (hit_axes, ttft_axes, outcome_axes):
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=7 if axes is outcome_axes else 8)
    figure.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, format="png")
