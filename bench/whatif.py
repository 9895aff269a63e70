"""``hiserve-bench trace`` and ``hiserve-bench whatif``: cache traces without a server,
and hit rates by tier size replayed from a trace (engine/cache_trace.py, bench/whatif_*.py).

    hiserve-bench trace --workload multiturn --page-size 16 -o trace.jsonl
    hiserve-bench whatif trace.jsonl --device-tokens 20000 --plot curves.png

A server writes the same trace with ``--cache-trace PATH``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.whatif_grid import CURVES, GridSpec, default_jobs, format_report, what_if, write_plot
from bench.whatif_sim import SimConfig
from bench.workloads import Workload, generate
from engine.cache_trace import TraceRecord, make_record, read_trace, write_trace


def workload_trace(workload: Workload, page_size: int, tokenizer: Any = None) -> list[TraceRecord]:
    """The trace a server would write for ``workload`` sent one request at a time.

    Request ``i`` arrives at ``i`` s and finishes at ``i + 0.5`` s. Prompts are the token
    ids, or in text mode the text tokenized by ``tokenizer`` (the server's). Output pages
    are left out: the server's output tokens are not known here (the replay counts them
    as new pages, as a workload whose history is synthetic does).
    """
    records = []
    for i, request in enumerate(workload.requests):
        ids = request.prompt
        if request.text is not None and tokenizer is not None:
            ids = list(tokenizer.encode(request.text))
        records.append(make_record(ids, len(ids), request.max_tokens, page_size, float(i), i + 0.5))
    return records


def _trace_main(argv: Sequence[str]) -> int:
    from bench.__main__ import add_workload_args, workload_config

    parser = argparse.ArgumentParser(
        prog="hiserve-bench trace",
        description="Write the cache trace of a workload, without a server.",
    )
    add_workload_args(parser)
    parser.add_argument("--page-size", type=int, default=1, help="the server's --page-size")
    parser.add_argument("-o", "--output", required=True, help="trace file (JSONL) to write")
    args = parser.parse_args(argv)
    if args.page_size < 1:
        parser.error("--page-size must be >= 1")
    try:
        workload = generate(workload_config(args))
    except ValueError as exc:
        parser.error(str(exc))
    tokenizer = None
    if workload.config.prompt_mode == "text":
        from engine.loader import DEFAULT_MODEL, load_tokenizer, resolve_model_path

        tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    records = workload_trace(workload, args.page_size, tokenizer)
    write_trace(args.output, args.page_size, f"workload:{workload.config.workload}", records)
    print(f"{len(records)} requests written to {args.output}")
    return 0


def _whatif_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hiserve-bench whatif",
        description="Replay a cache trace through the real prefix tree at a grid of tier "
        "sizes; print the hit rate per tier and the sizes reaching 90/95/99%% of an "
        "infinite cache.",
    )
    parser.add_argument("trace", help="a trace from --cache-trace or hiserve-bench trace")
    parser.add_argument(
        "--device-tokens",
        type=int,
        default=None,
        help="device pool (the server's --kv-cache-tokens) above the host and L3 sweeps; "
        "default: a tenth of the trace's footprint",
    )
    parser.add_argument(
        "--host-tokens",
        type=int,
        default=0,
        help="host tier above the L3 sweep (default: the device pool's size)",
    )
    parser.add_argument(
        "--curves", nargs="+", choices=CURVES, default=["device", "host"], help="what to sweep"
    )
    parser.add_argument("--points", type=int, default=20, help="sizes per curve")
    parser.add_argument("--load-threshold", type=int, default=16)
    parser.add_argument("--prefetch-threshold", type=int, default=256)
    parser.add_argument("--jobs", type=int, default=default_jobs(), help="processes")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--plot", dest="plot_path", default=None, help="PNG of the curves")
    args = parser.parse_args(argv)
    try:
        trace = read_trace(args.trace)
    except (OSError, ValueError) as exc:
        print(f"hiserve-bench whatif: error: {exc}", file=sys.stderr)
        return 2
    from bench.whatif_grid import footprint_tokens

    page = trace.page_size
    device = args.device_tokens or max(footprint_tokens(trace.records, page) // 10, page)
    base = SimConfig(
        page,
        device,
        args.host_tokens,
        0,
        args.load_threshold,
        args.prefetch_threshold,
    )
    started = time.perf_counter()
    report = what_if(trace.records, GridSpec(base, tuple(args.curves), args.points), args.jobs)
    report["seconds"] = round(time.perf_counter() - started, 2)
    print(format_report(report))
    print(
        f"\n{report['seconds']} s for {sum(len(c['points']) for c in report['curves'].values())} replays"
    )
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    if args.plot_path:
        write_plot(args.plot_path, report)
        print(f"plot written to {args.plot_path}")
    return 0


def main(argv: Sequence[str]) -> int:
    """``argv[0]`` is ``trace`` or ``whatif``."""
    if argv[0] == "trace":
        return _trace_main(argv[1:])
    return _whatif_main(argv[1:])
