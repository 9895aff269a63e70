"""What writing a cache trace costs: throughput with ``--cache-trace`` against without.

    python -m bench.trace_cost [--num-requests 64] [--rounds 5] [--device cpu]

Two engines on the same model and settings, one writing a trace (engine/cache_trace.py)
to a temporary file, run the same batch of requests in alternating rounds (off, on, off,
on, ...), so drift on a shared machine falls on both. Prints each engine's output tokens/s
per round, the medians and their ratio (the goal of issue 29: with traces on, under 2%
less throughput), and the records the trace holds, which must equal the requests run.

The batch is made of short requests (prompts of 64-512 tokens, 8-32 output tokens), the
worst case for a tracer, whose work is per finished request and per prompt page.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from bench.offline import make_workload, run_engine
from engine import Engine, EngineConfig


def _engine(device: str, trace: Path | None) -> Engine:
    return Engine(
        EngineConfig(
            model="default",
            device=device,
            dtype="float32",
            kv_cache_tokens=32768,
            max_running_requests=64,
            cache_trace=None if trace is None else str(trace),
        )
    )


def _records(trace: Path) -> int:
    """Request lines in ``trace`` (every line but the header)."""
    with trace.open() as fh:
        return max(0, sum(1 for _ in fh) - 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    prompts, out_lens = make_workload(
        args.num_requests, args.seed, (100, 40000), (64, 512), (8, 32)
    )
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        plain, traced = _engine(args.device, None), _engine(args.device, trace)
        try:
            for engine in (plain, traced):
                run_engine(engine, prompts[:2], [4, 4])  # warm-up
            off: list[float] = []
            on: list[float] = []
            for r in range(args.rounds):
                off.append(run_engine(plain, prompts, out_lens))
                on.append(run_engine(traced, prompts, out_lens))
                print(f"round {r + 1}: trace off {off[-1]:7.1f}  on {on[-1]:7.1f} output tok/s")
        finally:
            plain.close()
            traced.close()  # flushes the writer: every queued record is on disk
        records = _records(trace)
    expected = (args.rounds * args.num_requests) + 2
    median_off, median_on = statistics.median(off), statistics.median(on)
    print(
        f"median: off {median_off:.1f}, on {median_on:.1f} output tok/s; "
        f"on / off = {median_on / median_off:.3f} (goal >= 0.98)"
    )
    print(f"trace records: {records} of {expected} requests run")


if __name__ == "__main__":
    main()
