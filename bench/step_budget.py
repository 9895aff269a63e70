"""What ``--prefill-step-budget-ms`` buys a short request next to long prompts, in process.

    python -m bench.step_budget [--model default] [--budgets none 100 50] [--reps 5]
                                [--long-len 480] [--long-count 2] [--short-tokens 8]
                                [--batch 16] [--batch-prompt-len 400 800]

Issue 25's ``copies_flood`` measures it through HTTP with a canary sent every 0.5 s,
whose phase against the long prefill step is chance; here the timing is set. One engine
per budget (``none``: only the token limits), the same prompts for each, greedy, and two
scenarios in every repetition, the budgets taken in turn:

- ``arrives``: the long prompts are added, and ``--arrive-after`` seconds later the
  short request (an 8-token prompt, ``--short-tokens`` output tokens) arrives: it is
  added before the first step that starts after that, and its latency counts from the
  arrival, so the step in progress when it came counts too (as for an HTTP request);
- ``running``: the short request is added and its first step runs, then the long
  prompts arrive.

For each it prints medians of the short request's latency (added to finished) and of
the long prompts' time to first token, and each budget's ratio to ``none``. The first
repetition warms up and is not counted.

What the budget costs: the output tokens/s of a batch of ``--batch`` requests arriving
together, prompts of ``--batch-prompt-len`` tokens and 16-64 output tokens (bench.offline's
workload; 0: not measured), whose prompts a budget cuts into many small steps, each of
which reads every weight once more. Medians of the same repetitions.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.offline import make_workload, run_engine
from engine import Engine, EngineConfig, SamplingParams

SCENARIOS = ("arrives", "running")


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(length)]


def run_once(
    engine: Engine,
    scenario: str,
    longs: list[list[int]],
    short: list[int],
    short_tokens: int,
    arrive_after: float,
) -> tuple[float, float]:
    """(the short request's latency, the long prompts' median time to first token), s."""
    engine.flush_cache()
    long_params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    short_params = SamplingParams(max_tokens=short_tokens, temperature=0, ignore_eos=True)
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}

    def add(prompt: list[int], params: SamplingParams, at: float | None = None) -> str:
        request_id = engine.add_request(prompt, params)
        added[request_id] = time.perf_counter() if at is None else at
        return request_id

    def step() -> None:
        for out in engine.step():
            now = time.perf_counter()
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = now

    if scenario == "arrives":
        long_ids = [add(p, long_params) for p in longs]
        arrival = time.perf_counter() + arrive_after
        while time.perf_counter() < arrival:
            if engine.has_work:
                step()
            else:
                time.sleep(arrival - time.perf_counter())
        short_id = add(short, short_params, at=arrival)
    else:
        short_id = add(short, short_params)
        step()
        long_ids = [add(p, long_params) for p in longs]
    while engine.has_work:
        step()
    ttft = statistics.median(first[i] - added[i] for i in long_ids)
    return done[short_id] - added[short_id], ttft


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--budgets", nargs="+", default=["none", "100", "50"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--long-len", type=int, default=480)
    parser.add_argument("--long-count", type=int, default=2)
    parser.add_argument("--short-tokens", type=int, default=8)
    parser.add_argument("--arrive-after", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--batch-prompt-len", type=int, nargs=2, default=(400, 800), metavar=("MIN", "MAX")
    )
    args = parser.parse_args(argv)
    budgets = [None if b == "none" else float(b) for b in args.budgets]
    longs = [_prompt(args.long_len, seed) for seed in range(args.long_count)]
    short = _prompt(8, 99)
    engines = {
        b: Engine(
            EngineConfig(
                model=args.model,
                device="cpu",
                kv_cache_tokens=max(
                    4096,
                    2 * args.long_len * args.long_count,
                    args.batch * (args.batch_prompt_len[1] + 64),
                ),
                prefill_step_budget_ms=b,
            )
        )
        for b in budgets
    }
    results: dict[tuple[str, float | None], list[tuple[float, float]]] = {}
    batch_prompts, batch_outs = make_workload(
        args.batch, 0, (100, 30000), tuple(args.batch_prompt_len), (16, 64)
    )
    throughput: dict[float | None, list[float]] = {}
    try:
        for rep in range(args.reps + 1):
            for scenario in SCENARIOS:
                for budget, engine in engines.items():
                    measured = run_once(
                        engine, scenario, longs, short, args.short_tokens, args.arrive_after
                    )
                    if rep:  # the first repetition warms up
                        results.setdefault((scenario, budget), []).append(measured)
            for budget, engine in engines.items():
                if args.batch and rep:
                    rate = run_engine(engine, batch_prompts, batch_outs)
                    throughput.setdefault(budget, []).append(rate)
    finally:
        for engine in engines.values():
            engine.close()
    print(
        f"{args.long_count} prompts of {args.long_len} tokens and one 8-token prompt "
        f"asking {args.short_tokens} tokens; medians of {args.reps} repetitions"
    )
    print(
        f"{'scenario':<9} {'budget ms':>9} {'short s':>8} {'x none':>7} {'long TTFT s':>12} {'x none':>7}"
    )
    for scenario in SCENARIOS:
        base_short, base_ttft = _medians(results.get((scenario, None), []))
        for budget in budgets:
            short_s, ttft_s = _medians(results[(scenario, budget)])
            name = "none" if budget is None else f"{budget:g}"
            print(
                f"{scenario:<9} {name:>9} {short_s:>8.3f} {_ratio(short_s, base_short):>7} "
                f"{ttft_s:>12.3f} {_ratio(ttft_s, base_ttft):>7}"
            )
    if not throughput:
        return
    lo, hi = args.batch_prompt_len
    print(f"batch of {args.batch}, prompts {lo}-{hi} tokens, 16-64 output tokens each:")
    base = statistics.median(throughput[None]) if None in throughput else float("nan")
    for budget in budgets:
        rate = statistics.median(throughput[budget])
        name = "none" if budget is None else f"{budget:g}"
        print(f"{'batch':<9} {name:>9} {rate:>8.1f} tok/s {_ratio(rate, base):>7}")


def _medians(runs: list[tuple[float, float]]) -> tuple[float, float]:
    if not runs:
        return float("nan"), float("nan")
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def _ratio(value: float, base: float) -> str:
    return "-" if base != base or base == 0 else f"{value / base:.2f}"


if __name__ == "__main__":
    main()
