"""How long ``hiserve-bench whatif`` takes: a long-tail trace of N requests (default 100k)
replayed over a grid of tier sizes (default 20 host-tier sizes under one device pool).

    python -m bench.whatif_speed --requests 100000 --points 20 --jobs 2

Prints the seconds to build the trace (hashing), to replay the grid, and per replayed
request.
"""

from __future__ import annotations

import argparse
import time

from bench.whatif import workload_trace
from bench.whatif_grid import GridSpec, footprint_tokens, what_if
from bench.whatif_sim import SimConfig
from bench.workloads import WorkloadConfig, generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--documents", type=int, default=5_000)
    parser.add_argument("--doc-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--points", type=int, default=20)
    parser.add_argument("--curves", nargs="+", default=["host"])
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    config = WorkloadConfig(
        workload="long-tail",
        num_prompts=args.requests,
        num_groups=args.documents,
        shared_prefix_len=args.doc_len,
        suffix_len=args.suffix_len,
        output_len=16,
        range_ratio=0.5,
    )
    started = time.perf_counter()
    records = workload_trace(generate(config), args.page_size)
    built = time.perf_counter() - started
    footprint = footprint_tokens(records, args.page_size)
    base = SimConfig(args.page_size, max(footprint // 20, args.page_size))
    spec = GridSpec(base, tuple(args.curves), args.points)
    started, cpu_started = time.perf_counter(), time.process_time()
    report = what_if(records, spec, args.jobs)
    replayed = time.perf_counter() - started
    cpu = time.process_time() - cpu_started  # this process only: meaningful with --jobs 1
    replays = sum(len(c["points"]) for c in report["curves"].values())
    print(
        f"{len(records)} requests, {sum(len(r.pages) for r in records)} page hashes, "
        f"footprint {footprint} tokens; trace built in {built:.1f} s"
    )
    print(
        f"{replays} grid points x {len(records)} requests replayed in {replayed:.1f} s with "
        f"{args.jobs} processes"
    )
    if args.jobs == 1:
        per = cpu / (replays * len(records))
        print(
            f"{cpu:.1f} s of CPU: {per * 1e6:.0f} us per replayed request; a 20-point grid "
            f"of 100k requests needs {per * 100_000 * 20:.0f} CPU s"
        )


if __name__ == "__main__":
    main()
