"""Structured-output goals on the engine (no HTTP): validity, decode overhead, cached TTFT.

    python -m bench.grammar [--model default] [--device cpu] [--requests 32]
                            [--max-tokens 48] [--seeds 4] [--ttft-trials 8]

1. Validity: constrained requests over seeds, batch sizes and sampling settings; every
   reply that ends with ``stop`` must parse and validate (``jsonschema``). Goal: 100%.
2. Overhead: ``--requests`` requests decoding together, all constrained, against the same
   run unconstrained; decode tokens/s of each and the ratio. Goal: >= 85%.
3. Cached-grammar TTFT: time to first token of a request whose grammar is already
   compiled, minus that of the same request unconstrained (median). Goal: < 1 ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import jsonschema
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.grammar_spec import GrammarSpec
from engine.request import Req

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
# A long free string: the constrained run decodes as many tokens as the free one.
STORY = {
    "type": "object",
    "properties": {"story": {"type": "string"}},
    "required": ["story"],
}
PROMPT = "<|im_start|>user\nInvent a person and reply in JSON.<|im_end|>\n<|im_start|>assistant\n"
SAMPLING: list[dict[str, Any]] = [
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 20, "repetition_penalty": 1.2},
]


def validity(engine: Engine, seeds: int, max_tokens: int) -> dict[str, Any]:
    spec = GrammarSpec.json_schema(PERSON, "response_format")
    total = stopped = valid = 0
    for batch in (1, 8):
        for knobs in SAMPLING:
            for seed in range(seeds):
                params = [
                    SamplingParams(
                        max_tokens=max_tokens, seed=seed * 100 + i, grammar=spec, **knobs
                    )
                    for i in range(batch)
                ]
                for out in engine.generate([PROMPT] * batch, params):
                    total += 1
                    if out.finish_reason != "stop":
                        continue
                    stopped += 1
                    try:
                        jsonschema.validate(json.loads(out.text), PERSON)
                        valid += 1
                    except (ValueError, jsonschema.ValidationError):
                        print(f"INVALID: {out.text!r}")
    return {
        "replies": total,
        "stopped": stopped,
        "valid": valid,
        "valid_pct": 100 * valid / max(stopped, 1),
    }


def decode_rate(
    engine: Engine, requests: int, max_tokens: int, constrained: bool
) -> tuple[float, float]:
    """(decode tokens/s, ms per step spent filling and applying masks) over the decode
    steps that run all ``requests`` together.

    NOTE: constrained replies may end early; only steps at the full batch count, so both
    runs are measured at the same batch size. The mask time is measured on its own
    because on a busy host the step times of two runs are not comparable.
    """
    spec = GrammarSpec.json_schema(STORY, "response_format") if constrained else None
    engine.flush_cache()
    for i in range(requests):
        params = SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=not constrained, grammar=spec
        )
        engine.add_request(f"{PROMPT}{i}", params)
    decode_s = 0.0
    decode_tokens = 0
    masker = engine.grammars.masker
    mask_s = [0.0]
    fill, apply = masker.fill, masker.apply

    def timed(fn: Any) -> Any:
        def run(*a: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a)
            finally:
                mask_s[0] += time.perf_counter() - start

        return run

    masker.fill, masker.apply = timed(fill), timed(apply)  # type: ignore[method-assign]
    steps = 0
    while engine.has_work:
        running = engine.scheduler.running
        full_decode = (
            len(running) == requests
            and not engine.scheduler.waiting
            and all(r.kv_len == r.seq_len - 1 for r in running)
        )
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        if full_decode:
            decode_s += elapsed
            decode_tokens += sum(len(o.new_token_ids) for o in outputs)
            steps += 1
    masker.fill, masker.apply = fill, apply  # type: ignore[method-assign]
    return decode_tokens / max(decode_s, 1e-9), 1e3 * mask_s[0] / max(steps, 1)


def cached_ttft(engine: Engine, trials: int) -> dict[str, float]:
    """What a cached grammar adds before the first token: end to end (noisy on a busy
    host), and the grammar work alone (lookup, matcher, first mask fill and apply)."""
    spec = GrammarSpec.json_schema({**PERSON, "title": "cold"}, "response_format")
    cold_start = time.perf_counter()
    engine.grammar.submit(spec).result()
    cold_ms = 1e3 * (time.perf_counter() - cold_start)

    def grammar_setup() -> float:
        start = time.perf_counter()
        req = Req("setup", [1, 2], SamplingParams(grammar=spec))
        req.grammar = engine.grammar.start(spec)
        req.grammar.poll(time.monotonic())
        mask = engine.grammars.masker.fill([req])
        assert mask is not None
        mask.apply(torch.zeros(1, engine.vocab_size))
        return 1e3 * (time.perf_counter() - start)

    def ttft(grammar: GrammarSpec | None, i: int) -> float:
        engine.flush_cache()
        start = time.perf_counter()
        engine.add_request(
            f"{PROMPT} {i}", SamplingParams(max_tokens=1, temperature=0, grammar=grammar)
        )
        while engine.has_work:
            engine.step()
        return time.perf_counter() - start

    ttft(None, -1)  # warm-up
    diffs = [1e3 * (ttft(spec, i) - ttft(None, i)) for i in range(trials)]
    return {
        "compile_cold_ms": round(cold_ms, 2),
        "cached_grammar_setup_ms_median": round(
            statistics.median(grammar_setup() for _ in range(max(trials, 20))), 3
        ),
        "ttft_added_ms_median": round(statistics.median(diffs), 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--ttft-trials", type=int, default=8)
    args = parser.parse_args(argv)
    engine = Engine(
        EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            max_running_requests=max(args.requests, 8),
        )
    )
    result: dict[str, Any] = {}
    if args.seeds > 0:
        result["validity"] = validity(engine, args.seeds, 80)
        print(json.dumps(result["validity"]), flush=True)
    free, _ = decode_rate(engine, args.requests, args.max_tokens, constrained=False)
    constrained, mask_ms = decode_rate(engine, args.requests, args.max_tokens, constrained=True)
    result["overhead"] = {
        "running": args.requests,
        "free_tok_s": round(free, 1),
        "constrained_tok_s": round(constrained, 1),
        "ratio_pct": round(100 * constrained / free, 1),
        "mask_ms_per_step": round(mask_ms, 2),
        "free_step_ms": round(1e3 * args.requests / free, 1),
    }
    print(json.dumps(result["overhead"]), flush=True)
    result["ttft"] = cached_ttft(engine, args.ttft_trials)
    print(json.dumps(result["ttft"]), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
