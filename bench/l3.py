"""What the HiCache L3 tier buys, in process: restarts and replicas over one store.

    python -m bench.l3 [--backends none file mooncake] [--prompts 12 --prefix-len 480]

Two scenarios per backend, each on fresh engines over the same store:
- restart: questions about distinct documents run once cold, the engine is closed (its
  device and host tiers are lost) and a new engine asks new questions about the same
  documents (the documents are the shared prefixes);
- replicas: multi-turn conversations whose rounds alternate between two engines (what
  round-robin routing does), so every round's history was computed by the other one.
It prints the hit rate against the ideal (full pages of the prefixes seen before),
mean TTFT (one-token requests) of the second pass against the cold one, and the output
tokens/s of a batch whose KV is being written to the store, against the first backend
listed (``none``). The
``mooncake`` backend starts its own master and holder on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from engine import Engine, EngineConfig, SamplingParams

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


@contextmanager
def store_settings(backend: str) -> Iterator[dict[str, object]]:
    """Engine settings for ``backend``, with whatever it needs running meanwhile."""
    if backend == "none":
        yield {}
        return
    if backend == "file":
        with tempfile.TemporaryDirectory(prefix="hiserve-l3-") as directory:
            yield {"hicache_storage_backend": "file", "hicache_storage_dir": directory}
        return
    from bench.mooncake_local import Mooncake

    cluster = Mooncake(segment="2GB")  # the workload's pages must fit the holder
    try:
        yield {
            "hicache_storage_backend": "mooncake",
            "hicache_mooncake_master": cluster.master,
            "hicache_mooncake_metadata_server": cluster.metadata,
        }
    finally:
        cluster.stop()


def make_engine(args: argparse.Namespace, store: dict[str, object]) -> Engine:
    return Engine(
        EngineConfig(
            model=args.model,
            device="cpu",
            dtype="float32",
            kv_cache_tokens=args.kv_cache_tokens,
            page_size=args.page_size,
            enable_hierarchical_cache=True,
            hicache_mem_layout="page_first",
            hicache_storage_prefetch_threshold=args.page_size,
            hicache_storage_prefetch_policy="wait_complete",
            **store,  # type: ignore[arg-type]
        )
    )


def timed(engine: Engine, prompt: list[int]) -> tuple[float, int, int]:
    """(seconds to the first token, cached tokens, of which from the store)."""
    start = time.perf_counter()
    out = engine.generate([prompt], ONE_TOKEN)[0]
    return time.perf_counter() - start, out.cached_tokens, out.cached_tokens_storage


def restart(args: argparse.Namespace, store: dict[str, object]) -> dict[str, float]:
    """Documents asked about before a restart, then asked again (other questions) after."""
    rng = random.Random(args.seed)
    docs = [
        [rng.randrange(100, 40000) for _ in range(args.prefix_len)] for _ in range(args.prompts)
    ]

    def question() -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(32)]

    cold_engine = make_engine(args, store)
    cold = [timed(cold_engine, doc + question())[0] for doc in docs]
    cold_engine.close()
    warm_engine = make_engine(args, store)
    again = [doc + question() for doc in docs]
    warm = [timed(warm_engine, prompt) for prompt in again]
    warm_engine.close()
    cached = sum(c for _, c, _ in warm)
    return {
        "hit_vs_ideal": cached / sum(len(doc) // args.page_size * args.page_size for doc in docs),
        "ttft_ratio": statistics.mean(t for t, _, _ in warm) / statistics.mean(cold),
    }


def replicas(args: argparse.Namespace, store: dict[str, object]) -> dict[str, float]:
    rng = random.Random(args.seed + 1)
    engines = [make_engine(args, store), make_engine(args, store)]
    convos = [[rng.randrange(100, 40000) for _ in range(args.prefix_len)] for _ in range(4)]
    cached = possible = 0
    seen = [0] * len(convos)  # tokens of each conversation computed in earlier rounds
    for turn in range(args.rounds):
        engine = engines[turn % 2]  # round-robin: every round lands on the other replica
        for c, convo in enumerate(convos):
            _, hit, _ = timed(engine, convo)
            if turn:
                cached += hit
                possible += seen[c] // args.page_size * args.page_size  # the history's pages
            seen[c] = len(convo)
            convos[c] = convo + [rng.randrange(100, 40000) for _ in range(48)]
        storage = getattr(engine.kv.manager.tree, "storage", None)
        if storage is not None:
            storage.drain()  # both replicas run at once; this makes the round's writes land
    for engine in engines:
        engine.close()
    return {"hit_vs_ideal": cached / max(possible, 1)}


def decode(args: argparse.Namespace, store: dict[str, object]) -> float:
    """Output tokens/s of a batch whose prompts and outputs are written to the store."""
    rng = random.Random(args.seed + 2)
    batch = [[rng.randrange(100, 40000) for _ in range(args.prefix_len)] for _ in range(8)]
    engine = make_engine(args, store)
    engine.generate([batch[0][:32]], ONE_TOKEN)  # warm-up
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(batch, params)
    seconds = time.perf_counter() - start
    engine.close()
    return sum(len(o.token_ids) for o in outs) / seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--backends", nargs="+", default=["none", "file", "mooncake"])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--prefix-len", type=int, default=480)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-cache-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(
        "| L3 backend | restart: hit / ideal | restart: TTFT warm / cold "
        "| replicas: hit / ideal | output tok/s vs first |"
    )
    print("|---|---|---|---|---|")
    baseline = None
    for backend in args.backends:
        with store_settings(backend) as store:
            after_restart = restart(args, store)
        with store_settings(backend) as store:
            shared = replicas(args, store)
        with store_settings(backend) as store:
            throughput = decode(args, store)
        baseline = baseline or throughput  # the first backend listed (none by default)
        print(
            f"| {backend} | {after_restart['hit_vs_ideal']:.2f} | "
            f"{after_restart['ttft_ratio']:.2f} | {shared['hit_vs_ideal']:.2f} | "
            f"{throughput / baseline:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
