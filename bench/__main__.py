"""``python -m bench`` / ``hiserve-bench``: load tests of OpenAI-compatible servers.

    python -m bench run --base-url http://127.0.0.1:8000 --workload multiturn --json out.json
    python -m bench compare --target radix --target hicache --kv-cache-tokens 2048 --plot out.png

    python -m bench l3 --backends none file mooncake   # the L3 tier, restarts and replicas
    python -m bench trace --workload multiturn -o trace.jsonl   # a cache trace, no server
    python -m bench whatif trace.jsonl --plot curves.png       # hit rates by tier size

``run`` may be left out: ``python -m bench --base-url ...`` means ``run``.
Exit status: 0 when every request succeeded, 1 when any failed or a run stopped early
(partial results are still printed and written), 2 for bad arguments, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import secrets
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

from bench.client import normalize_base_url, parse_logit_bias
from bench.compare import SERVER_CONFIGS, LaunchOptions, parse_target, run_compare
from bench.report import build_report, format_table, write_json, write_plot
from bench.runner import RunOptions, RunState, run_blocking
from bench.workloads import PROMPT_MODES, WORKLOADS, Workload, WorkloadConfig, generate

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload flags (also read by ``hiserve-bench trace``)."""
    defaults = WorkloadConfig()
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default=defaults.workload)
    w.add_argument("--seed", type=int, default=defaults.seed)
    w.add_argument(
        "--prompt-mode",
        choices=PROMPT_MODES,
        default=defaults.prompt_mode,
        help="tokens: token-id prompts; text: real words (needed through a router); "
        "token counts then come from the server's usage",
    )
    w.add_argument(
        "--output-len",
        type=int,
        default=defaults.output_len,
        help="max_tokens of every request (sent with ignore_eos)",
    )
    w.add_argument(
        "--range-ratio",
        type=float,
        default=defaults.range_ratio,
        help="lengths are drawn from [L*ratio, L]; 1.0: fixed lengths",
    )
    w.add_argument(
        "--vocab-range",
        type=int,
        nargs=2,
        metavar=("LOW", "HIGH"),
        default=(defaults.vocab_low, defaults.vocab_high),
        help="token ids of the synthetic prompts are drawn from [LOW, HIGH)",
    )
    w.add_argument("--num-clients", type=int, default=defaults.num_clients)
    w.add_argument("--num-rounds", type=int, default=defaults.num_rounds)
    w.add_argument("--system-prompt-len", type=int, default=defaults.system_prompt_len)
    w.add_argument("--user-turn-len", type=int, default=defaults.user_turn_len)
    w.add_argument(
        "--assistant-turn-len",
        type=int,
        default=defaults.assistant_turn_len,
        help="synthetic assistant turn appended to the history after each round",
    )
    w.add_argument("--num-groups", type=int, default=defaults.num_groups)
    w.add_argument("--prompts-per-group", type=int, default=defaults.prompts_per_group)
    w.add_argument("--shared-prefix-len", type=int, default=defaults.shared_prefix_len)
    w.add_argument("--suffix-len", type=int, default=defaults.suffix_len)
    w.add_argument("--num-prompts", type=int, default=defaults.num_prompts)
    w.add_argument("--input-len", type=int, default=defaults.input_len)
    w.add_argument(
        "--zipf-s",
        type=float,
        default=defaults.zipf_s,
        help="long-tail: document popularity ~ 1/rank^s",
    )


def _add_common(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser)
    t = parser.add_argument_group("traffic")
    t.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second; default inf: no pacing",
    )
    t.add_argument("--max-concurrency", type=int, default=None)
    t.add_argument(
        "--api-key",
        default=os.environ.get("HISERVE_API_KEY") or None,
        help="bearer key of the target (default: $HISERVE_API_KEY, which keeps it out of ps)",
    )
    t.add_argument(
        "--served-model-name",
        default=None,
        help="`model` field of the requests; default: the target's first model",
    )
    t.add_argument(
        "--logit-bias",
        default=None,
        metavar="JSON",
        help="every request's logit_bias, e.g. '{\"2\": -100}' to ban EOS where ignore_eos "
        "is ignored (default: none)",
    )
    t.add_argument("--request-timeout", type=float, default=600.0)
    t.add_argument(
        "--max-retries",
        type=int,
        default=3,
        help="retries of a request answered 503/429 or refused, with backoff",
    )
    t.add_argument(
        "--retry-backoff",
        type=float,
        default=0.5,
        help="first retry delay in seconds; doubles each retry",
    )
    t.add_argument(
        "--no-flush", action="store_true", help="do not call /flush_cache before each run"
    )
    o = parser.add_argument_group("output")
    o.add_argument("--json", dest="json_path", default=None, help="write the results here")
    o.add_argument("--plot", dest="plot_path", default=None, help="write a PNG plot here")
    o.add_argument("--no-progress", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hiserve-bench",
        description="Load-test OpenAI-compatible servers: cache-hit "
        "rate (achieved vs ideal), TTFT, inter-token latency and throughput. "
        "`hiserve-bench l3 --help`: the HiCache L3 tier across restarts and replicas.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one workload against one server URL")
    run.add_argument("--base-url", default="http://127.0.0.1:8000")
    run.add_argument("--label", default=None, help="column name in the table")
    _add_common(run)
    compare = sub.add_parser("compare", help="one workload against several targets")
    compare.add_argument(
        "--target",
        dest="targets",
        action="append",
        required=True,
        help=f"a URL, a server config to launch ({', '.join(SERVER_CONFIGS)}), or "
        "fleet:POLICY (--replicas servers behind the smg router with that policy, e.g. "
        "fleet:cache_aware); optionally as LABEL=VALUE; repeat for each column",
    )
    launch = compare.add_argument_group("launched servers")
    launch.add_argument("--model", default="default")
    launch.add_argument("--device", default="cpu")
    launch.add_argument("--dtype", default="float32")
    launch.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="device KV pool; make it smaller than the working set",
    )
    launch.add_argument("--hicache-ratio", type=float, default=None)
    launch.add_argument(
        "--server-arg",
        dest="server_args",
        action="append",
        default=[],
        help="extra flag for launched servers (repeat; use --server-arg=--x)",
    )
    launch.add_argument("--startup-timeout", type=float, default=300.0)
    launch.add_argument(
        "--replicas", type=int, default=2, help="servers behind the router of a fleet target"
    )
    launch.add_argument(
        "--router-arg",
        dest="router_args",
        action="append",
        default=[],
        help="extra smg flag for fleet targets (repeat; --router-arg=--cache-threshold=0.5)",
    )
    _add_common(compare)
    return parser


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        workload=args.workload,
        seed=args.seed,
        prompt_mode=args.prompt_mode,
        vocab_low=args.vocab_range[0],
        vocab_high=args.vocab_range[1],
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        num_clients=args.num_clients,
        num_rounds=args.num_rounds,
        system_prompt_len=args.system_prompt_len,
        user_turn_len=args.user_turn_len,
        assistant_turn_len=args.assistant_turn_len,
        num_groups=args.num_groups,
        prompts_per_group=args.prompts_per_group,
        shared_prefix_len=args.shared_prefix_len,
        suffix_len=args.suffix_len,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        zipf_s=args.zipf_s,
    )


def check_router_args(router_args: Sequence[str]) -> None:
    """Refuse flags the router would refuse, before any server is launched."""
    if not router_args:
        return
    try:
        from smg.launch_router import parse_router_args
    except ImportError as exc:
        raise ValueError("fleet targets need the router: pip install 'hiserve[fleet]'") from exc
    try:
        with contextlib.redirect_stderr(io.StringIO()) as errors:
            parse_router_args(list(router_args))
    except SystemExit:
        last = errors.getvalue().strip().splitlines()[-1:]
        raise ValueError(
            f"--router-arg: smg refuses {list(router_args)}: {' '.join(last)}"
        ) from None


def _error(message: str) -> None:
    print(f"hiserve-bench: error: {message}", file=sys.stderr, flush=True)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _finish(
    args: argparse.Namespace,
    states: Sequence[RunState],
    workload: Workload,
    options: RunOptions,
    interrupted: bool,
) -> int:
    """Print the table and write JSON/plot from whatever completed; pick the exit status."""
    reports = [build_report(state, workload, options) for state in states]
    if not reports:
        return EXIT_INTERRUPTED if interrupted else EXIT_FAILED
    print(format_table(reports), flush=True)
    if args.json_path:
        payload: dict[str, Any] = (
            dict(reports[0])
            if args.command == "run"
            else {"workload": workload.config.to_dict(), "targets": reports}
        )
        payload["partial"] = interrupted or any(
            r["aborted"] or r["failed"] or r["not_sent"] for r in reports
        )
        write_json(args.json_path, payload)
        print(f"results written to {args.json_path}", flush=True)
    if args.plot_path:
        try:
            write_plot(args.plot_path, reports)
            print(f"plot written to {args.plot_path}", flush=True)
        except (ImportError, OSError) as exc:
            _error(
                f"could not write the plot ({exc}); install matplotlib (pip install "
                "'hiserve[bench]') or choose another --plot path"
            )
    status = EXIT_OK
    for report in reports:
        if report["aborted"]:
            _error(f"[{report['label']}] stopped early: {report['aborted']}")
            status = EXIT_FAILED
        elif report["failed"] or report["not_sent"]:
            first = report["errors"][0]["message"] if report["errors"] else "unknown error"
            _error(
                f"[{report['label']}] {report['failed']} of {report['total_requests']} "
                f"requests failed; first error: {first}"
            )
            status = EXIT_FAILED
        if report["cache_flushed"] is False:
            print(
                f"note: [{report['label']}] has no /flush_cache; runs may warm each other",
                file=sys.stderr,
            )
    return EXIT_INTERRUPTED if interrupted else status


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "l3":
        from bench.l3_http import main as l3_main

        return l3_main(argv[1:])
    if argv and argv[0] in ("trace", "whatif"):
        from bench.whatif import main as whatif_main

        return whatif_main(argv)
    if argv and argv[0] not in ("run", "compare", "-h", "--help"):
        argv.insert(0, "run")
    args = build_parser().parse_args(argv)
    try:
        workload = generate(workload_config(args))
        options = RunOptions(
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            flush_cache=not args.no_flush,
            progress=not args.no_progress,
            seed=args.seed,
        )
        targets = [parse_target(t) for t in args.targets] if args.command == "compare" else []
        if any(t.policy for t in targets):
            if workload.config.prompt_mode != "text":
                raise ValueError("fleet targets need --prompt-mode text (smg refuses token ids)")
            if args.replicas < 1:
                raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
            check_router_args(args.router_args)
            # the router and its replicas share one key; the client must send it
            args.api_key = args.api_key or "bench-" + secrets.token_hex(8)
        if args.command == "run":
            normalize_base_url(args.base_url)  # raises on a malformed URL
        logit_bias = None if args.logit_bias is None else parse_logit_bias(args.logit_bias)
    except ValueError as exc:
        _error(str(exc))
        return EXIT_USAGE
    client_kwargs = dict(
        model=args.served_model_name,
        api_key=args.api_key,
        timeout=args.request_timeout,
        max_retries=args.max_retries,
        retry_backoff=args.retry_backoff,
        logit_bias=logit_bias,
    )
    total = len(workload.requests)

    def run_one(state: RunState) -> None:
        run_blocking(state, workload, options, **client_kwargs)

    states: list[RunState] = []
    interrupted = False
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        if args.command == "run":
            states.append(RunState(args.label or args.base_url, args.base_url, total))
            run_one(states[0])
        else:
            launch = LaunchOptions(
                model=args.model,
                device=args.device,
                dtype=args.dtype,
                kv_cache_tokens=args.kv_cache_tokens,
                hicache_ratio=args.hicache_ratio,
                api_key=args.api_key,
                extra_args=tuple(args.server_args),
                startup_timeout=args.startup_timeout,
                replicas=args.replicas,
                router_args=tuple(args.router_args),
            )
            run_compare(
                targets,
                launch,
                run_one,
                states,
                total,
                log=lambda msg: print(msg, file=sys.stderr, flush=True),
            )
    except KeyboardInterrupt:
        interrupted = True
        _error("interrupted; writing what completed so far")
    except Exception as exc:  # a bug or an unexpected environment: report it, keep results
        _error(f"unexpected {type(exc).__name__}: {exc}")
        if states and states[-1].aborted is None:
            states[-1].aborted = f"{type(exc).__name__}: {exc}"
    finally:
        signal.signal(signal.SIGTERM, previous)
    return _finish(args, states, workload, options, interrupted)


if __name__ == "__main__":
    sys.exit(main())
