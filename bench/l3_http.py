"""``hiserve-bench l3``: what the HiCache L3 tier buys, over HTTP, on real server processes.

    hiserve-bench l3 [--backends none file mooncake] [--documents 12 --doc-len 480]

For each backend, two ``python -m server`` replicas on 127.0.0.1 over one store (a
fresh directory for ``file``; for ``mooncake`` a master and a holder started here):
- restart: questions about distinct documents go to replica 0 (pass 1, cold); it is
  stopped (SIGTERM: it drains, its device and host tiers are lost) and started again;
  pass 2 asks new questions about the same documents, the shared prefixes;
- replicas: multi-turn conversations whose rounds alternate between the two replicas
  (what round-robin routing does), so every round's history was computed by the other;
  between rounds the bench waits until both replicas' L3 writes have landed (a user's
  think time is longer than that);
- decode: a batch of requests on replica 0, whose prompts and outputs are written to
  the store while it decodes.
It prints the hit rate against the ideal (full pages of what was computed before), the
mean TTFT (one-token requests) of each restart pass, and output tokens/s against the
first backend listed (``none``: the host tier without a store).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.client import CompletionClient, RequestResult
from bench.fleet import LocalFleet
from bench.workloads import BenchRequest

BACKENDS = ("none", "file", "mooncake")
WRITES_PENDING = "hiserve:hicache_storage_writes_pending"


@dataclass(frozen=True)
class L3Options:
    """The servers launched and the traffic sent to them."""

    model: str = "default"
    device: str = "cpu"
    dtype: str = "float32"
    kv_cache_tokens: int = 8192
    page_size: int = 16
    documents: int = 12
    doc_len: int = 480
    question_len: int = 32
    conversations: int = 4
    rounds: int = 4
    turn_len: int = 48
    decode_requests: int = 8
    decode_tokens: int = 64
    seed: int = 0
    startup_timeout: float = 600.0
    server_args: tuple[str, ...] = ()
    log_dir: Path | None = None


@dataclass
class BackendResult:
    """What one backend measured; hit rates are cached tokens over the ideal."""

    backend: str
    restart_hit: float = 0.0
    ttft_cold_s: float = 0.0
    ttft_warm_s: float = 0.0
    replicas_hit: float = 0.0
    output_tok_s: float = 0.0

    @property
    def ttft_ratio(self) -> float:
        return self.ttft_warm_s / self.ttft_cold_s if self.ttft_cold_s else 0.0


def server_flags(options: L3Options, store: Sequence[str]) -> list[str]:
    return [
        "--model", options.model, "--device", options.device, "--dtype", options.dtype,
        "--kv-cache-tokens", str(options.kv_cache_tokens),
        "--page-size", str(options.page_size),
        "--enable-hierarchical-cache", "--hicache-mem-layout", "page_first",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-prefetch-threshold", str(options.page_size),
        *store, *options.server_args,
    ]  # fmt: skip


@contextmanager
def store_flags(backend: str) -> Iterator[list[str]]:
    """Server flags for ``backend``, with whatever it needs running meanwhile."""
    if backend == "none":
        yield []
        return
    if backend == "file":
        with tempfile.TemporaryDirectory(prefix="hiserve-l3-") as directory:
            yield ["--hicache-storage-backend", "file", "--hicache-storage-dir", directory]
        return
    from bench.mooncake_local import Mooncake

    cluster = Mooncake(segment="2GB")  # the workload's pages must fit the holder
    try:
        yield [
            "--hicache-storage-backend", "mooncake",
            "--hicache-mooncake-master", cluster.master,
            "--hicache-mooncake-metadata-server", cluster.metadata,
        ]  # fmt: skip
    finally:
        cluster.stop()


class Replica:
    """A client of one replica: one-off requests, and waiting for its L3 writes."""

    def __init__(self, url: str, api_key: str) -> None:
        self.url, self.api_key = url, api_key
        self.client = CompletionClient(url, api_key=api_key, max_retries=5)

    async def __aenter__(self) -> Replica:
        models = await self.client.probe()
        self.client.model = models[0] if models else None
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()

    async def ask(self, prompt: list[int], max_tokens: int = 1) -> RequestResult:
        result = await self.client.complete(BenchRequest(0, prompt, max_tokens, 0, 0))
        if not result.ok:
            raise RuntimeError(f"request to {self.url} failed: {result.error}")
        return result

    async def settle(self, timeout: float = 120.0) -> None:
        """Wait until every L3 write this replica queued has landed in the store."""
        deadline = time.monotonic() + timeout
        headers = {"Authorization": f"Bearer {self.api_key}"}
        async with httpx.AsyncClient(base_url=self.url, headers=headers) as http:
            while time.monotonic() < deadline:
                response = await http.get("/metrics", timeout=10.0)
                if writes_pending(response.text) == 0:
                    return
                await asyncio.sleep(0.05)  # polling a remote gauge; nothing to wait on
        raise TimeoutError(f"{self.url}: L3 writes still pending after {timeout:.0f} s")


def writes_pending(metrics_text: str) -> float:
    """L3 writes a replica has not finished, from its /metrics text (0 without L3)."""
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name == WRITES_PENDING:
            return float(value)
    return 0.0


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def _full_pages(n: int, page_size: int) -> int:
    return n // page_size * page_size


async def restart_pass(
    url: str, api_key: str, docs: list[list[int]], rng: random.Random, question_len: int
) -> list[RequestResult]:
    async with Replica(url, api_key) as replica:
        # A fresh server's first forward pays one-off costs; neither pass should carry them.
        await replica.ask(_tokens(random.Random(rng.random()), 32))
        return [await replica.ask(doc + _tokens(rng, question_len)) for doc in docs]


async def round_robin(
    urls: list[str], api_key: str, options: L3Options, rng: random.Random
) -> float:
    """Rounds of each conversation alternate between the replicas; hit rate vs ideal."""
    convos = [_tokens(rng, options.doc_len) for _ in range(options.conversations)]
    seen = [0] * len(convos)  # tokens of each conversation computed in earlier rounds
    cached = possible = 0
    async with Replica(urls[0], api_key) as first, Replica(urls[1], api_key) as second:
        replicas = [first, second]
        for turn in range(options.rounds):
            replica = replicas[turn % 2]
            for c, convo in enumerate(convos):
                result = await replica.ask(convo)
                if turn:
                    cached += result.cached_tokens or 0
                    possible += _full_pages(seen[c], options.page_size)
                seen[c] = len(convo)
                convos[c] = convo + _tokens(rng, options.turn_len)
            await replica.settle()
    return cached / max(possible, 1)


async def decode(url: str, api_key: str, options: L3Options, rng: random.Random) -> float:
    """Output tokens/s of a batch sent at once."""
    prompts = [_tokens(rng, options.doc_len) for _ in range(options.decode_requests)]
    async with Replica(url, api_key) as replica:
        await replica.ask(_tokens(rng, 32))  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(replica.ask(p, options.decode_tokens) for p in prompts))
        seconds = time.perf_counter() - start
    return sum(r.output_tokens for r in results) / seconds


def run_backend(backend: str, options: L3Options, log_dir: Path) -> BackendResult:
    """Both scenarios and the decode batch on fresh replicas over a fresh store."""
    result = BackendResult(backend)
    rng = random.Random(options.seed)
    docs = [_tokens(rng, options.doc_len) for _ in range(options.documents)]
    api_key = "l3-" + secrets.token_hex(8)
    with store_flags(backend) as store:
        fleet = LocalFleet(
            2,
            "round_robin",  # no router is started; the bench alternates itself
            log_dir / backend,
            server_args=server_flags(options, store),
            api_key=api_key,
            ready_timeout=options.startup_timeout,
        )
        fleet.start_replicas()
        try:
            urls = [w.url for w in fleet.workers]
            cold = asyncio.run(restart_pass(urls[0], api_key, docs, rng, options.question_len))
            fleet.workers[0].stop()  # SIGTERM: the server drains, its L3 writes land
            fleet.restart_replica(0)
            warm = asyncio.run(restart_pass(urls[0], api_key, docs, rng, options.question_len))
            ideal = sum(_full_pages(len(d), options.page_size) for d in docs)
            result.restart_hit = sum(r.cached_tokens or 0 for r in warm) / ideal
            result.ttft_cold_s = statistics.mean(r.ttft or 0.0 for r in cold)
            result.ttft_warm_s = statistics.mean(r.ttft or 0.0 for r in warm)
            result.replicas_hit = asyncio.run(round_robin(urls, api_key, options, rng))
            result.output_tok_s = asyncio.run(decode(urls[0], api_key, options, rng))
        finally:
            fleet.stop()
    return result


def format_table(results: list[BackendResult]) -> str:
    lines = [
        "| L3 backend | restart: hit / ideal | TTFT pass 1 (ms) | TTFT pass 2 (ms) "
        "| pass 2 / pass 1 | replicas: hit / ideal | output tok/s | vs first |",
        "|---|---|---|---|---|---|---|---|",
    ]
    baseline = results[0].output_tok_s if results else 0.0
    for r in results:
        lines.append(
            f"| {r.backend} | {r.restart_hit:.2f} | {r.ttft_cold_s * 1e3:.0f} | "
            f"{r.ttft_warm_s * 1e3:.0f} | {r.ttft_ratio:.2f} | {r.replicas_hit:.2f} | "
            f"{r.output_tok_s:.1f} | {r.output_tok_s / baseline if baseline else 0:.2f} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    defaults = L3Options()
    parser = argparse.ArgumentParser(
        prog="hiserve-bench l3", description=__doc__.splitlines()[0].split(": ", 1)[1]
    )
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    for name in (
        "model", "device", "dtype", "kv_cache_tokens", "page_size", "documents", "doc_len",
        "question_len", "conversations", "rounds", "turn_len", "decode_requests",
        "decode_tokens", "seed", "startup_timeout",
    ):  # fmt: skip
        default = getattr(defaults, name)
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    parser.add_argument(
        "--server-arg",
        dest="server_args",
        action="append",
        default=[],
        help="extra flag for every launched server (repeat; use --server-arg=--x)",
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="server logs (default: temp)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    options = L3Options(
        **{k: v for k, v in vars(args).items() if k not in ("backends", "server_args")},
        server_args=tuple(args.server_args),
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="hiserve-bench-l3-") as scratch:
        log_dir = options.log_dir or Path(scratch)
        for backend in args.backends:
            print(f"[{backend}] starting replicas", file=sys.stderr, flush=True)
            results.append(run_backend(backend, options, log_dir))
    print(format_table(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
