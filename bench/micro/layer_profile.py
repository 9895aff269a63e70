"""Where a decode step's time goes, by op, at a few batch sizes (CPU, the engine's model).

    python -m bench.micro.layer_profile [--model default] [--running 1 8 32] [--steps 10]
                                  [--top 25] [--threads N]

For each number of running requests (contexts of 20-200 tokens), it prefills them, runs a
few warm-up decode steps, then profiles ``--steps`` decode steps with torch.profiler and
prints the ops by self CPU time per step. The native kernels (attention, fused norms,
RoPE, SwiGLU, the KV write) and the linear layers do not all show as ATen ops, so each is
wrapped in a ``record_function`` label (``hs::...``) while profiling; their rows give the
total time inside each kernel call. It also prints the step time without the profiler and
the linear layers alone on the same shapes (the matmul floor of one step), so the
non-matmul part is ``step - matmuls``.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from engine import Engine, EngineConfig, SamplingParams
from engine.layers.linear import FusedLinear
from engine.layers.rmsnorm import RMSNorm


def _labelled(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def labels(engine: Engine) -> Iterator[None]:
    """Within the block, the model's kernels run under ``hs::`` profiler labels."""
    model: Any = engine.model
    undo: list[Callable[[], None]] = []

    def patch(obj: Any, name: str, label: str) -> None:
        original = getattr(obj, name)
        if original is None:
            return
        had_own = name in vars(obj)
        setattr(obj, name, _labelled(label, original))
        undo.append(
            (lambda: setattr(obj, name, original))
            if had_own
            else (lambda: vars(obj).pop(name, None))
        )

    for module in model.modules():
        if isinstance(module, FusedLinear):
            patch(module, "forward", "hs::linear")
        elif isinstance(module, RMSNorm):
            patch(module, "add_forward", "hs::add_rms_norm")
        if hasattr(module, "rotary_fn"):
            patch(module, "rotary_fn", "hs::rotary")
        if hasattr(module, "act_mul"):
            patch(module, "act_mul", "hs::swiglu")
    backends = {
        id(layer.self_attn.attn_backend): layer.self_attn.attn_backend
        for layer in model.model.layers
    }
    for backend in backends.values():
        patch(backend, "_decode", "hs::attention_decode")
        if hasattr(backend, "_store_kv"):
            patch(backend, "_store_kv", "hs::kv_write")
    patch(model, "compute_logits", "hs::lm_head")
    patch(engine.runner, "sampler", "hs::sampler")
    try:
        yield
    finally:
        for fn in reversed(undo):
            fn()


def start_decoding(engine: Engine, running: int, seed: int, max_tokens: int) -> None:
    """Admit ``running`` requests with 20-200 token contexts and prefill them all.

    NOTE: ``max_tokens`` stays small: admission reserves KV for it, and a large one would
    hold most requests back in the waiting queue.
    """
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for _ in range(running):
        engine.add_request([rng.randrange(100, 40000) for _ in range(rng.randint(20, 200))], params)
    # Every request has sampled once: its prompt is in the pool, the next steps decode.
    while engine.scheduler.waiting or any(not r.output_ids for r in engine.scheduler.running):
        engine.step()


def step_matmuls(model: Any, tokens: int, repeats: int = 5) -> float:
    """Best seconds of one decode step's linear layers alone (LM head included)."""
    linears = [m for n, m in model.named_modules() if isinstance(m, FusedLinear) and n != "lm_head"]
    hidden = int(model.config.hidden_size)
    inputs = {m.in_features: torch.zeros(tokens, m.in_features) for m in linears}
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for linear in linears:
            linear.forward(inputs[linear.in_features])
        model.compute_logits(torch.zeros(tokens, hidden))
        best = min(best, time.perf_counter() - start)
    return best


def step_time(engine: Engine, steps: int) -> float:
    """Best seconds of one decode step over ``steps`` steps."""
    best = float("inf")
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        best = min(best, time.perf_counter() - start)
    return best


def profile_steps(engine: Engine, steps: int, top: int) -> str:
    with labels(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    table: str = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--running", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--no-profile", action="store_true", help="step times only")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    engine = Engine(
        EngineConfig(
            model=args.model,
            device="cpu",
            dtype="float32",
            kv_cache_tokens=32768,
            max_running_requests=64,
            enable_prefix_cache=False,
        )
    )
    try:
        model: Any = engine.model
        layers = int(model.config.num_hidden_layers)
        for running in args.running:
            # Warm-up, timed and profiled steps, with room to spare.
            start_decoding(engine, running, seed=running, max_tokens=3 * args.steps + 16)
            step_time(engine, 3)  # warm-up
            step_s = step_time(engine, args.steps)
            matmul_s = step_matmuls(engine.model, running)
            rest_us = (step_s - matmul_s) * 1e6
            print(
                f"\n== {running} running: decode step {step_s * 1e3:.1f} ms, linear layers "
                f"alone {matmul_s * 1e3:.1f} ms ({100 * matmul_s / step_s:.0f}%); the rest "
                f"{rest_us / 1e3:.1f} ms = {rest_us / layers:.0f} us per layer"
            )
            if not args.no_profile:
                print(f"(profiler totals over {args.steps} steps; divide by {args.steps})")
                print(profile_steps(engine, args.steps, args.top))
            for req in list(engine.scheduler.running):
                engine.abort(req.request_id)
            while engine.has_work:
                engine.step()
    finally:
        engine.close()


if __name__ == "__main__":
    main()
