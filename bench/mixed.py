"""Mixed batches against the alternating scheduler, through HTTP (issue #15).

    python -m bench.mixed [--request-rate 5] [--num-prompts 64] [--input-len 128]
                          [--output-len 32] [--server-arg=--flag ...]

Starts a server with mixed batches (the default) and then one with
``--disable-mixed-batches``, one after the other on 127.0.0.1, and sends each the same
random workload twice: with Poisson arrivals at ``--request-rate`` (pick a rate that keeps
about 16 requests running; the table prints the mean), and one request at a time. Then it
times decode-only steps in process, on an engine of the same configuration with the
mixed run's mean number of running requests all decoding: the floor a stream's
inter-token latency could reach if no prefill ever joined its steps.

``--in-process N`` skips HTTP: N pairs of engine-only runs (mixed, then alternating) of
the Poisson workload in this process, for output tokens/s and median inter-token latency
without the server's own per-token cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.compare import LaunchedServer, LaunchOptions
from bench.report import build_report
from bench.runner import RunOptions, RunState, run_blocking
from bench.workloads import Workload, WorkloadConfig, generate
from engine import Engine, EngineConfig, SamplingParams

MODES = {"mixed": (), "alternating": ("--disable-mixed-batches",)}


def mean_running(report: dict[str, Any]) -> float:
    """Requests in flight on average over the run (Little's law: busy time / duration)."""
    busy = sum(r["e2e_latency"] or 0.0 for r in report["requests"] if r["ok"])
    return busy / report["duration"] if report["duration"] else 0.0


def serve_and_run(
    mode: str, launch: LaunchOptions, runs: Sequence[tuple[Workload, RunOptions]]
) -> list[dict[str, Any]]:
    """One server in ``mode``; each (workload, options) run against it in turn."""
    options = dataclasses.replace(launch, extra_args=(*launch.extra_args, *MODES[mode]))
    reports = []
    print(f"launching a server with {mode} steps ...", file=sys.stderr, flush=True)
    with LaunchedServer("radix", options) as server:
        for workload, run_options in runs:
            state = RunState(mode, server.url, len(workload.requests))
            run_blocking(state, workload, run_options, max_retries=0)
            report = build_report(state, workload, run_options)
            if report["failed"] or report["aborted"]:
                raise RuntimeError(f"{mode}: requests failed: {report['errors'][:3]}")
            reports.append(report)
    return reports


def launched_engine(launch: LaunchOptions, **switches: bool) -> Engine:
    """An engine in this process with the model, device, dtype and KV pool ``launch`` gives
    the servers it starts, and the engine ``switches`` on top (config defaults otherwise)."""
    return Engine(
        EngineConfig(
            model=launch.model,
            device=launch.device,
            dtype=launch.dtype,
            kv_cache_tokens=launch.kv_cache_tokens,
            **switches,  # type: ignore[arg-type]
        )
    )


def decode_step_ms(
    launch: LaunchOptions, batch: int, input_len: int, steps: int, seed: int
) -> float:
    """Median wall time of a decode-only step with ``batch`` requests decoding."""
    engine = launched_engine(launch)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(1000, 40000) for _ in range(input_len)], params)
    while engine.scheduler.waiting or any(
        not r.output_ids for r in engine.scheduler.running
    ):  # every prompt prefilled: what follows is decode only
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.close()
    return 1e3 * statistics.median(times)


def engine_run(
    launch: LaunchOptions, mixed: bool, workload: Workload, rate: float, seed: int
) -> tuple[float, float]:
    """The workload on an engine in this process, Poisson arrivals at ``rate`` by the wall
    clock (no HTTP): (output tokens/s, median inter-token latency in ms)."""
    engine = launched_engine(launch, enable_mixed_batches=mixed)
    rng = random.Random(seed)
    arrivals, at = [], 0.0
    for request in workload.requests:
        at += rng.expovariate(rate)
        arrivals.append((at, request.prompt))
    params = SamplingParams(max_tokens=workload.config.output_len, temperature=0, ignore_eos=True)
    token_times: dict[str, list[float]] = {}
    start = time.perf_counter()
    while arrivals or engine.has_work:
        now = time.perf_counter() - start
        while arrivals and arrivals[0][0] <= now:
            token_times[engine.add_request(arrivals.pop(0)[1], params)] = []
        if not engine.has_work:
            time.sleep(arrivals[0][0] - now)  # idle until the next arrival
            continue
        outputs = engine.step()
        done = time.perf_counter() - start
        for out in outputs:  # one new token per request and step
            token_times[out.request_id].append(done)
    elapsed = time.perf_counter() - start
    engine.close()
    gaps = [b - a for times in token_times.values() for a, b in itertools.pairwise(times)]
    tokens = sum(len(times) for times in token_times.values())
    return tokens / elapsed, 1e3 * statistics.median(gaps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--request-rate", type=float, default=5.0)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--range-ratio", type=float, default=0.5)
    parser.add_argument("--single-prompts", type=int, default=6, help="for concurrency 1")
    parser.add_argument("--decode-steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--in-process",
        type=int,
        default=0,
        metavar="N",
        help="instead of HTTP: N alternating pairs of in-process runs (engine only)",
    )
    parser.add_argument(
        "--server-arg",
        dest="server_args",
        action="append",
        default=[],
        help="extra flag for both servers (repeat; use --server-arg=--x)",
    )
    args = parser.parse_args(argv)

    config = WorkloadConfig(
        workload="random",
        seed=args.seed,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
    )
    loaded = generate(config)
    single = generate(dataclasses.replace(config, num_prompts=args.single_prompts))
    runs = [
        (loaded, RunOptions(request_rate=args.request_rate, progress=False, seed=args.seed)),
        (single, RunOptions(max_concurrency=1, progress=False, seed=args.seed)),
    ]
    launch = LaunchOptions(model=args.model, extra_args=tuple(args.server_args))
    if args.in_process:
        for _ in range(args.in_process):
            for mode, mixed in (("mixed", True), ("alternating", False)):
                tok_s, itl = engine_run(launch, mixed, loaded, args.request_rate, args.seed)
                print(f"in process, {mode:<12} {tok_s:7.1f} output tok/s, median ITL {itl:.1f} ms")
        return
    results = {mode: serve_and_run(mode, launch, runs) for mode in MODES}
    running = mean_running(results["mixed"][0])
    batch = max(1, round(running))
    step_ms = decode_step_ms(launch, batch, args.input_len, args.decode_steps, args.seed)

    def row(name: str, values: dict[str, float], unit: str) -> None:
        mixed, alternating = values["mixed"], values["alternating"]
        print(f"{name:<34}{mixed:>10.1f}{alternating:>13.1f}{mixed / alternating:>9.2f}x  {unit}")

    print(
        f"\nrandom workload: {args.num_prompts} prompts of {args.input_len} tokens "
        f"(range ratio {args.range_ratio}), {args.output_len} output tokens; "
        f"Poisson {args.request_rate}/s; then {args.single_prompts} at concurrency 1"
    )
    print(f"{'':<34}{'mixed':>10}{'alternating':>13}{'ratio':>10}")
    poisson = {m: r[0] for m, r in results.items()}
    one = {m: r[1] for m, r in results.items()}
    row("output tok/s", {m: r["output_throughput"] for m, r in poisson.items()}, "")
    row("median ITL", {m: 1e3 * r["itl"]["p50"] for m, r in poisson.items()}, "ms")
    row("p90 ITL", {m: 1e3 * r["itl"]["p90"] for m, r in poisson.items()}, "ms")
    row("median TTFT", {m: 1e3 * r["ttft"]["p50"] for m, r in poisson.items()}, "ms")
    row("mean running", {m: mean_running(r) for m, r in poisson.items()}, "requests")
    row("concurrency 1: output tok/s", {m: r["output_throughput"] for m, r in one.items()}, "")
    row("concurrency 1: median ITL", {m: 1e3 * r["itl"]["p50"] for m, r in one.items()}, "ms")
    itl_ms = 1e3 * poisson["mixed"]["itl"]["p50"]
    gain = poisson["mixed"]["output_throughput"] / poisson["alternating"]["output_throughput"]
    print(f"decode-only step at {batch} running (in process): {step_ms:.1f} ms")
    print(
        f"goals: mixed median ITL / decode step = {itl_ms / step_ms:.2f}x (<= 1.2x); "
        f"output tok/s mixed / alternating = {gain:.2f}x (>= 1.2x)"
    )


if __name__ == "__main__":
    main()
