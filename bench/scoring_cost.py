"""What a scoring request (prompt logprobs, as `echo` + `logprobs` asks) costs against a
plain prefill of the same prompts, in one process on one engine.

    python -m bench.scoring_cost [--model default] [--prompts 16] [--prompt-len 256]

For the same prompts, alternating ``--repeats`` times (best time of each kind):

- ``prefill``: one generated token, the cache flushed first (a prefill of every prompt);
- ``scoring``: ``max_tokens`` 0 with ``prompt_logprobs`` 1, the cache flushed first (what
  lm-eval's loglikelihood requests ask for);
- ``scoring, prompt cached``: the same after a plain request left every prompt's pages
  in the prefix cache: the cache holds K/V, not logits, so the whole prompt is computed
  again;
- ``prefill, prompt cached``: the plain request again, for contrast (what the cache saves
  a request that needs no scores).

It also counts the tokens each kind forwards and the logit rows it computes: a scoring
request forwards each prompt token once (one prefill) and computes a logit row for every
position but the first, the only work a plain prefill does not.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.offline import _patched, make_workload
from engine import Engine, EngineConfig
from engine.request import SamplingParams

KINDS = ("prefill", "scoring", "scoring, prompt cached", "prefill, prompt cached")


def plain() -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def scoring() -> SamplingParams:
    return SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=1)


def run_kind(engine: Engine, kind: str, prompts: list[list[int]]) -> tuple[float, tuple[int, int]]:
    """Seconds the timed part of ``kind`` took, and the tokens it forwarded and the logit
    rows it computed."""
    params: Callable[[], SamplingParams] = scoring if kind.startswith("scoring") else plain
    engine.flush_cache()
    if kind.endswith("cached"):
        engine.generate(prompts, [plain() for _ in prompts])  # leaves the pages cached
    counts = [0, 0]  # tokens forwarded, logit rows computed
    with (
        _patched(engine.model, "forward", lambda fn: _counting(fn, counts, 0)),
        _patched(engine.model, "compute_logits", lambda fn: _counting(fn, counts, 1)),
    ):
        start = time.perf_counter()
        outs = engine.generate(prompts, [params() for _ in prompts])
        elapsed = time.perf_counter() - start
    if kind.startswith("scoring"):
        for out, prompt in zip(outs, prompts):  # every position but the first is scored
            assert out.prompt_logprobs is not None
            assert sum(p is not None for p in out.prompt_logprobs) == len(prompt) - 1
    return elapsed, (counts[0], counts[1])


def _counting(fn: Callable[..., Any], counts: list[int], field: int) -> Callable[..., Any]:
    """``fn`` that adds its first argument's row count to ``counts[field]``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counts[field] += int(args[0].shape[0])
        return fn(*args, **kwargs)

    return wrapper


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32", help="engine --dtype (auto, float32, ...)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.set_grad_enabled(False)
    engine = Engine(
        EngineConfig(
            model=args.model,
            device="cpu",
            dtype=args.dtype,
            kv_cache_tokens=max(32768, 2 * args.prompts * (args.prompt_len + 16)),
            max_running_requests=max(64, args.prompts),
        )
    )
    try:
        vocab = (100, int(engine.model.config.vocab_size) - 100)
        length = (args.prompt_len, args.prompt_len)
        prompts, _ = make_workload(args.prompts, args.seed, vocab, length, (1, 1))
        run_kind(engine, "scoring", prompts[:2])  # warm-up: kernels built, buffers sized
        best = dict.fromkeys(KINDS, float("inf"))
        work: dict[str, tuple[int, int]] = {}
        for _ in range(args.repeats):
            for kind in KINDS:
                elapsed, work[kind] = run_kind(engine, kind, prompts)
                best[kind] = min(best[kind], elapsed)
    finally:
        engine.close()

    total = args.prompts * args.prompt_len
    print(
        f"{args.prompts} prompts x {args.prompt_len} tokens ({total} prompt tokens), "
        f"--dtype {args.dtype}, best of {args.repeats}"
    )
    print(f"{'kind':<24} {'seconds':>8} {'vs prefill':>10} {'tokens fwd':>10} {'logit rows':>10}")
    for kind in KINDS:
        tokens, rows = work[kind]
        ratio = best[kind] / best["prefill"]
        print(f"{kind:<24} {best[kind]:>8.3f} {ratio:>9.2f}x {tokens:>10} {rows:>10}")


if __name__ == "__main__":
    main()
