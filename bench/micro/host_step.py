"""Host time of whole decode steps, with a model that does no work: a GPU host's share.

    python -m bench.micro.host_step [--model default] [--batches 1 32 64 128]
                                    [--steps 50] [--rounds 4] [--threads 1]
                                    [--stream-interval 1] [--not-streamed]

On a GPU the forward runs on the device and the host's caches stay warm. On a CPU the
forward streams the weights through them: a small torch call that takes ~4 us on its own
took ~30 us right after a decode step of a one-layer model with the default vocabulary
(and ~60 us after summing 16 MB; 2026-12-07, this 2-core box). Host time measured inside
CPU decode steps therefore overstates a GPU host's several times over.

Here the model returns zeros for the forward and fixed random logits over the first
2,048 token ids for the LM head (a different row each step, so the text changes), so a
step is host work only: scheduling with the KV slots of every request
(``Scheduler.schedule``), the step's inputs, request-table upload, forward call and
sampling (``ModelRunner.run``), and landing the tokens: stops, detokenization, outputs
(``Engine._postprocess``). ``--batches`` prompts of 16 tokens start together, greedy, no
EOS; once all decode, ``--steps`` steps are timed. ``--stream-interval`` and
``--not-streamed`` set how often a running request gets an output (``output_due``).
Rounds repeat this; the first warms up. Printed per batch: medians over rounds of the
step, its parts and the step per request, in microseconds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from engine import Engine, EngineConfig, SamplingParams

PROMPT_LEN = 16
LOGIT_IDS = 2048  # the LM head's stand-in scores these token ids
PARTS = ("schedule", "run", "postprocess")


class NoWorkModel(torch.nn.Module):
    """The loaded model with its forward and LM head replaced by constant results."""

    def __init__(self, model: torch.nn.Module, rows: int = 1024) -> None:
        super().__init__()
        self.inner = model
        self.logits = torch.randn(2 * rows, LOGIT_IDS, generator=torch.Generator().manual_seed(0))
        self.rows = rows
        self.calls = 0

    def forward(self, input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], 8)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        start = self.calls % self.rows
        self.calls += 1
        return self.logits[start : start + hidden.shape[0]]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


def _timed(owner: Any, name: str, spent: dict[str, float]) -> None:
    """Add the seconds of every call of ``owner.name`` to ``spent`` under the name
    without its leading underscore."""
    method: Callable[..., Any] = getattr(owner, name)
    key = name.lstrip("_")

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - started

    setattr(owner, name, timed)


def measure(
    engine: Engine, batch: int, steps: int, rounds: int, stream: bool = True
) -> dict[str, float]:
    """Median seconds per decode step (``step``) and per part, over ``rounds`` - 1."""
    runner = engine.runner
    runner.model = NoWorkModel(runner.model)
    spent: dict[str, float] = defaultdict(float)
    _timed(engine.scheduler, "schedule", spent)
    _timed(runner, "run", spent)
    _timed(engine, "_postprocess", spent)
    rng = random.Random(0)
    vocab = engine.tokenizer.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(PROMPT_LEN)] for _ in range(batch)]
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True, stream=stream)
    per_round: list[dict[str, float]] = []
    for _ in range(rounds):
        engine.flush_cache()
        for prompt in prompts:
            engine.add_request(prompt, params)
        while sum(1 for r in engine.scheduler.running if r.output_ids) < batch:
            engine.step()  # the prefill
        spent.clear()
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - started
        per_round.append({"step": total / steps} | {k: spent[k] / steps for k in PARTS})
        while engine.has_work:
            engine.step()
    kept = per_round[1:] or per_round
    return {key: statistics.median(r[key] for r in kept) for key in kept[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64, 128])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's)")
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--not-streamed", action="store_true", help="requests that do not stream")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"host time per decode step, no-work model, {args.steps} steps, {args.rounds} rounds, "
        f"--stream-interval {args.stream_interval}" + (", not streamed" * args.not_streamed)
    )
    print(f"{'batch':>6} {'step us':>8} " + " ".join(f"{p:>11}" for p in PARTS) + " per request")
    for batch in args.batches:
        engine = Engine(
            EngineConfig(
                model=args.model,
                device="cpu",
                dtype="float32",
                kv_cache_tokens=batch * (PROMPT_LEN + args.steps + 32) + 4096,
                max_running_requests=max(batch, 1),
                max_prefill_tokens=batch * PROMPT_LEN,
                stream_interval=args.stream_interval,
            )
        )
        try:
            r = measure(engine, batch, args.steps, args.rounds, stream=not args.not_streamed)
        finally:
            engine.close()
        parts = " ".join(f"{1e6 * r[p]:>11.0f}" for p in PARTS)
        print(f"{batch:>6} {1e6 * r['step']:>8.0f} {parts} {1e6 * r['step'] / batch:>11.1f}")


if __name__ == "__main__":
    main()
