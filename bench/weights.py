"""Weight formats side by side: float32, bfloat16 and the GGUF blocks kept packed.

One run loads the model once per format (float32 and bf16 dense, dequantized from the GGUF
at load; packed: the GGUF's own blocks, float32 activations) and measures, for each, a
single stream and a batch of 32 through the engine (greedy, ``ignore_eos``), then the
bytes of weights one decode step reads against the read-only bandwidth measured in the
same run (bench/micro/bandwidth.py): the single stream's share of its own floor.

``read`` is a ceiling for any kernel: the same weight tensors, in the order a step uses
them, only read (a ``sum`` over each, torch's threads), no arithmetic. On a machine where
reading a step's tensors one by one already falls short of the one-stream floor (each
tensor's stream starts and ends, its threads meet at its end), no kernel can reach it.

Where a single-stream step's time goes, per format (medians over the single-stream
runs' steps): the model's forward (embedding and every layer), the LM head, sampling,
and the rest of the engine's step, beside the floor (the weights' bytes at the read
bandwidth), so the part a faster matmul cannot remove shows.

    python -m bench.weights [--model default] [--single-tokens 128] [--formats ...]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from bench.micro.bandwidth import read_bandwidth
from bench.offline import (
    _patched,
    make_workload,
    run_engine,
    step_weight_tensors,
    weight_bytes_per_token,
)
from engine import Engine, EngineConfig
from engine.layers.linear import FusedLinear
from engine.layers.quant_cpu import quant_kernel

# Format name -> the engine's --dtype for it (packed: auto on a GGUF, see dtypes.py).
FORMATS = {"float32": "float32", "bf16": "bfloat16", "packed": "auto"}


class FormatResult(NamedTuple):
    name: str
    single: float  # output tokens/s, one stream
    batch: float  # output tokens/s, batch of ``batch_size``
    bytes_per_token: int  # weights one decode step reads
    # Median seconds of a single-stream step in: forward, LM head, sampling, the whole
    # step; and the layers' linear layers alone at one token.
    parts: dict[str, float]


def _parts(engine: Engine) -> list[tuple[str, Any, str]]:
    """The parts of a single-stream step the breakdown times: (label, owner, attribute)."""
    return [
        ("forward", engine.model, "forward"),
        ("lm_head", engine.model, "compute_logits"),
        ("sampling", engine.runner, "sampler"),
        ("step", engine, "step"),
    ]


def _timing(fn: Callable[..., Any], seconds: list[float]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    return timed


def linears_alone(model: Any, passes: int = 10, rounds: int = 5) -> float:
    """Seconds one token takes through the layers' linear layers alone (not the LM head),
    best of ``rounds``: packed ones through the native ``PackedLinear`` the decode step
    calls, so Python's cost per call stays out of it."""
    calls = []
    for name, module in model.named_modules():
        if not isinstance(module, FusedLinear) or name == "lm_head":
            continue
        if module.packed is not None:
            call = module.packed.native_linear(quant_kernel(), module.bias)
        else:
            call = module.forward
        calls.append((call, torch.zeros(1, module.in_features)))
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(passes):
            for call, x in calls:
                call(x)
        best = min(best, (time.perf_counter() - start) / passes)
    return best


def read_alone(tensors: list[torch.Tensor], rounds: int = 7) -> float:
    """Best seconds to read every tensor once, in turn, by a ``sum`` over its bytes as
    float32 (a tensor's last 0-3 bytes left out): the step's weights without arithmetic.
    A meta tensor (a weight in oneDNN's opaque layout, bench.offline.step_weight_tensors)
    is read as a dense tensor of its size."""
    views = []
    for t in tensors:
        if t.is_meta:
            t = torch.ones(t.shape, dtype=t.dtype)
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        views.append(flat[: flat.numel() // 4 * 4].view(torch.float32))
    for v in views:  # warm: threads up, pages touched
        v.sum()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for v in views:
            v.sum()
        best = min(best, time.perf_counter() - start)
    return best


def measure_format(
    name: str, args: argparse.Namespace, prompts: list[list[int]], out_lens: list[int]
) -> FormatResult:
    engine = Engine(
        EngineConfig(
            model=args.model,
            device="cpu",
            dtype=FORMATS[name],
            kv_cache_tokens=32768,
            max_running_requests=64,
            enable_prefix_cache=False,
        )
    )
    try:
        if name == "packed" and not engine.weights.packed_gguf:
            raise SystemExit(f"{args.model} is not a GGUF model: nothing to keep packed")
        run_engine(engine, prompts[:2], [4, 4])  # warm-up (kernels built, pages touched)
        batch = run_engine(engine, prompts, out_lens)
        sink: dict[str, list[float]] = {}
        with contextlib.ExitStack() as stack:
            for label, owner, attr in _parts(engine):
                wrap = functools.partial(_timing, seconds=sink.setdefault(label, []))
                stack.enter_context(_patched(owner, attr, wrap))
            single = max(
                run_engine(engine, prompts[:1], [args.single_tokens]) for _ in range(args.repeats)
            )
        parts = {label: statistics.median(seconds) for label, seconds in sink.items()}
        parts["linears"] = linears_alone(engine.model)
        parts["read"] = read_alone(step_weight_tensors(engine.model))
        return FormatResult(name, single, batch, weight_bytes_per_token(engine.model), parts)
    finally:
        engine.close()
        del engine
        gc.collect()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="a GGUF model (default: SmolLM2)")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64, help="tokens per batch request")
    parser.add_argument("--single-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="single-stream runs (best kept)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.set_grad_enabled(False)
    prompts, _ = make_workload(args.batch_size, args.seed, (100, 40000), (16, 64), (1, 1))
    out_lens = [args.output_len] * args.batch_size
    print(
        f"model {args.model}; batch {args.batch_size} x {args.output_len} output tokens, "
        f"prompts 16-64 tokens; single stream {args.single_tokens} tokens; greedy, "
        f"{torch.get_num_threads()} threads"
    )
    results = [measure_format(name, args, prompts, out_lens) for name in args.formats]
    read = read_bandwidth()
    print(f"read-only bandwidth {read.best / 1e9:.2f} GB/s (median {read.median / 1e9:.2f})")
    print(f"{'format':8} {'single tok/s':>12} {'batch tok/s':>12} {'MB/token':>9} {'of floor':>9}")
    for r in results:
        floor = read.best / r.bytes_per_token  # tokens/s if reading weights were all
        print(
            f"{r.name:8} {r.single:12.1f} {r.batch:12.1f} {r.bytes_per_token / 1e6:9.1f} "
            f"{100 * r.single / floor:8.0f}%"
        )
    print(
        "single-stream step, ms (medians; floor: the weights' bytes at the read bandwidth; "
        "read: the step's weight tensors only read, one by one, best of 7; linears: the "
        "layers' linear layers alone, part of forward)"
    )
    print(
        f"{'format':8} {'floor':>6} {'read':>6} {'step':>6} {'forward':>8} {'linears':>8} "
        f"{'LM head':>8} {'sampling':>9} {'rest':>6}"
    )
    for r in results:
        p = {k: 1e3 * v for k, v in r.parts.items()}
        rest = p["step"] - p["forward"] - p["lm_head"] - p["sampling"]
        print(
            f"{r.name:8} {1e3 * r.bytes_per_token / read.best:6.2f} {p['read']:6.2f} "
            f"{p['step']:6.2f} "
            f"{p['forward']:8.2f} {p['linears']:8.2f} {p['lm_head']:8.2f} "
            f"{p['sampling']:9.2f} {rest:6.2f}"
        )
    for r in results:
        floor = r.bytes_per_token / read.best
        print(
            f"{r.name}: reading the step's weights alone takes {100 * floor / r.parts['read']:.0f}% "
            f"of the floor's speed; the step {100 * floor / r.parts['step']:.0f}%"
        )
    base = next((r for r in results if r.name == "float32"), None)
    if base is not None:
        for r in results:
            if r is not base:
                print(
                    f"{r.name} vs float32: single {r.single / base.single:.2f}x, "
                    f"batch {r.batch / base.batch:.2f}x"
                )


if __name__ == "__main__":
    main()
