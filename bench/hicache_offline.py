"""What HiCache buys, in process: a multi-turn workload whose working set exceeds the
device KV pool, run with no prefix cache, radix only, and HiCache.

    python -m bench.hicache_offline [--clients 8 --rounds 4 --kv-cache-tokens 1536]

For each configuration it prints the cache-hit rate (cached prompt tokens / prompt
tokens), the ideal hit rate of an unbounded cache on the same prompts, mean TTFT and
throughput. Then it times one long prompt cold, fully cached on the device, and cached
on the host tier only.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from engine import Engine, EngineConfig, SamplingParams


@dataclass
class RunResult:
    name: str
    prompt_tokens: int
    cached_tokens: int
    host_tokens: int
    ideal_cached: int
    ttft: list[float]
    output_tokens: int
    seconds: float
    outputs: list[list[int]]

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)

    @property
    def ideal_rate(self) -> float:
        return self.ideal_cached / max(self.prompt_tokens, 1)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def run_multiturn(
    engine: Engine,
    name: str,
    clients: int,
    rounds: int,
    first_len: int,
    turn_len: int,
    out_len: int,
    seed: int,
) -> RunResult:
    rng = random.Random(seed)
    convos = [[rng.randrange(100, 40000) for _ in range(first_len)] for _ in range(clients)]
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    seen: list[list[int]] = []  # token sequences whose KV an unbounded cache would hold
    result = RunResult(name, 0, 0, 0, 0, [], 0, 0.0, [])
    start = time.perf_counter()
    for r in range(rounds):
        for c in range(clients):  # interleaved: others' traffic sits between two turns
            if r > 0:
                convos[c] = convos[c] + [rng.randrange(100, 40000) for _ in range(turn_len)]
            prompt = convos[c]
            ideal = max((common_prefix(prompt, s) for s in seen), default=0)
            result.ideal_cached += min(ideal, len(prompt) - 1)
            out = engine.generate([prompt], params)[0]
            result.ttft.append((out.first_token_time or 0) - out.arrival_time)
            result.prompt_tokens += len(prompt)
            result.cached_tokens += out.cached_tokens
            result.host_tokens += out.cached_tokens_host
            result.output_tokens += len(out.token_ids)
            result.outputs.append(out.token_ids)
            seen.append(prompt + out.token_ids[:-1])
            convos[c] = prompt + out.token_ids
    result.seconds = time.perf_counter() - start
    return result


def long_prompt_ttft(engine: Engine, length: int, seed: int) -> tuple[float, float, float]:
    rng = random.Random(seed)
    prompt = [rng.randrange(100, 40000) for _ in range(length)]
    params = SamplingParams(max_tokens=1, temperature=0)

    def ttft() -> tuple[float, int, int]:
        out = engine.generate([prompt], params)[0]
        return (
            (out.first_token_time or 0) - out.arrival_time,
            out.cached_tokens_device,
            out.cached_tokens_host,
        )

    engine.flush_cache()
    cold, _, _ = ttft()
    device, dev_hit, _ = ttft()
    assert dev_hit == length - 1, dev_hit
    tree = engine.kv.manager.tree
    tree.evict(tree.cached_tokens)  # the prompt now lives on the host tier only
    host, _, host_hit = ttft()
    assert host_hit == length - 1, host_hit
    return cold, device, host


def make_engine(args: argparse.Namespace, name: str) -> Engine:
    return Engine(
        EngineConfig(
            model=args.model,
            device="cpu",
            dtype="float32",
            kv_cache_tokens=args.kv_cache_tokens,
            enable_prefix_cache=name != "no-cache",
            enable_hierarchical_cache=name == "hicache",
            hicache_ratio=args.hicache_ratio,
            hicache_write_policy=args.write_policy,
        )
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--first-len", type=int, default=300)
    parser.add_argument("--turn-len", type=int, default=60)
    parser.add_argument("--out-len", type=int, default=16)
    parser.add_argument("--kv-cache-tokens", type=int, default=1536)
    parser.add_argument("--hicache-ratio", type=float, default=6.0)
    parser.add_argument("--write-policy", default="write_through")
    parser.add_argument("--long-prompt", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    results = []
    for name in ("no-cache", "radix", "hicache"):
        engine = make_engine(args, name)
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))  # warm-up
        engine.flush_cache()
        results.append(
            run_multiturn(
                engine,
                name,
                args.clients,
                args.rounds,
                args.first_len,
                args.turn_len,
                args.out_len,
                args.seed,
            )
        )
        if name == "hicache":
            cold, device, host = long_prompt_ttft(
                Engine(
                    EngineConfig(
                        model=args.model,
                        device="cpu",
                        dtype="float32",
                        kv_cache_tokens=max(4096, args.long_prompt * 2),
                        enable_hierarchical_cache=True,
                    )
                ),
                args.long_prompt,
                args.seed,
            )
        engine.close()
    working_set = args.clients * (
        args.first_len + (args.rounds - 1) * args.turn_len + args.rounds * args.out_len
    )
    print(
        f"multi-turn: {args.clients} clients x {args.rounds} rounds, working set "
        f"~{working_set} tokens, device pool {args.kv_cache_tokens} tokens"
    )
    print(
        f"{'config':<10} {'hit rate':>9} {'ideal':>7} {'of ideal':>9} {'host hits':>10} "
        f"{'mean TTFT':>10} {'out tok/s':>10} {'req/s':>7}"
    )
    for r in results:
        print(
            f"{r.name:<10} {r.hit_rate:9.1%} {r.ideal_rate:7.1%} "
            f"{r.hit_rate / max(r.ideal_rate, 1e-9):9.1%} {r.host_tokens:10d} "
            f"{1e3 * sum(r.ttft) / len(r.ttft):8.1f}ms {r.output_tokens / r.seconds:10.1f} "
            f"{len(r.ttft) / r.seconds:7.2f}"
        )
    same = all(r.outputs == results[0].outputs for r in results)
    print(f"greedy outputs identical across configs: {same}")
    print(
        f"{args.long_prompt}-token prompt TTFT: cold {cold * 1e3:.0f} ms, device hit "
        f"{device * 1e3:.1f} ms ({device / cold:.1%} of cold), host hit {host * 1e3:.1f} ms "
        f"({host / cold:.1%} of cold)"
    )


if __name__ == "__main__":
    main()
