"""A batch's prefill and its decode steps, timed step by step (CPU or any device).

    python -m bench.decode_step [--model default] [--dtype bfloat16]
                                [--kv-cache-dtype bfloat16] [--batch 32]
                                [--prompt-len 128] [--output-len 128] [--rounds 2]

``--batch`` prompts of ``--prompt-len`` random tokens are added at once, each asking for
``--output-len`` tokens (greedy, no EOS); every ``Engine.step()`` is timed until all
finish. Printed per round: the first step (the prefill of every prompt), the median and
90th percentile of the decode steps, and output tokens/s over the whole round.

It refuses a run in which not every request is decoding by the first decode step (the
scheduler keeps KV room for each request's ``max_tokens``, so with a small pool or long
outputs part of the batch waits; and a step's prompt tokens are capped, so the bench
asks for the whole batch's in one): such a "batch of 32" decodes fewer, and its steps
look cheaper than they are. One earlier decode figure was that mistake (docs/weights.md,
2026-12-06, seventh session).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from engine import Engine, EngineConfig, SamplingParams
from engine.config import DTYPES, KV_CACHE_DTYPES


@dataclass(frozen=True)
class Round:
    prefill_s: float
    decode_steps_s: list[float]
    output_tokens: int
    total_s: float

    @property
    def median_ms(self) -> float:
        return 1e3 * statistics.median(self.decode_steps_s)

    @property
    def p90_ms(self) -> float:
        steps = sorted(self.decode_steps_s)
        return 1e3 * steps[min(len(steps) - 1, int(0.9 * len(steps)))]


def run_round(engine: Engine, prompts: list[list[int]], output_len: int) -> Round:
    """One batch from empty to done; raises when part of it waited for KV room."""
    engine.flush_cache()
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    steps: list[float] = []
    tokens = finished = 0
    start = time.perf_counter()
    while finished < len(prompts):
        begin = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - begin)
        # After the first decode step every request has its prefill's token and one more.
        decoding = sum(1 for r in engine.scheduler.running if len(r.output_ids) >= 2)
        if len(steps) == 2 and decoding < len(prompts) - finished:
            raise RuntimeError(
                f"only {decoding} of {len(prompts)} requests are decoding at the first "
                "decode step: raise --kv-cache-tokens or lower --output-len"
            )
        for out in outs:
            if out.finished:
                finished += 1
                tokens += len(out.token_ids)
    return Round(steps[0], steps[1:], tokens, time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--kv-cache-dtype", default="bfloat16", choices=KV_CACHE_DTYPES)
    parser.add_argument("--kv-cache-tokens", type=int, default=65536)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.output_len < 2:
        parser.error("--output-len must be at least 2 (a prefill and a decode step)")

    engine = Engine(
        EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_cache_tokens=args.kv_cache_tokens,
            # the first step is the whole batch's prefill, whatever the device's default
            max_prefill_tokens=args.batch * args.prompt_len,
            chunked_prefill_size=max(args.prompt_len, 1024),
        )
    )
    rng = random.Random(args.seed)
    vocab = engine.tokenizer.vocab_size
    prompts = [
        [rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)
    ]
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2))  # warm-up
    print(
        f"{args.batch} prompts of {args.prompt_len} tokens, {args.output_len} out, "
        f"--dtype {args.dtype} --kv-cache-dtype {args.kv_cache_dtype}"
    )
    for i in range(args.rounds):
        r = run_round(engine, prompts, args.output_len)
        print(
            f"round {i + 1}: prefill {1e3 * r.prefill_s:.0f} ms, decode step median "
            f"{r.median_ms:.1f} ms (p90 {r.p90_ms:.1f}), {r.output_tokens / r.total_s:.1f} "
            "output tok/s"
        )
    engine.close()


if __name__ == "__main__":
    main()
