"""Offline throughput: hiserve's Engine against HF ``generate`` on the same model and prompts.

    python -m bench.offline [--model default] [--num-requests 32] [--skip-hf] [--tp N]
                            [--disable-mixed-batches] [--kv-cache-dtype bfloat16]

Prints output tokens/s for a batch of requests with varied prompt and output lengths
(HF runs them as one left-padded batch to the longest output and is credited only with
the tokens that were asked for), single-stream tokens/s for both, and the engine's own
per-step overhead (everything in a step that is not the model forward).

It also prints the matmul floor of the engine's batch run: the same sequence of forward
shapes (tokens per step, logit rows per step) replayed through the model's linear layers
alone. No engine that runs that schedule with this BLAS can be faster than the floor, so
``output tokens / floor`` bounds the attainable tokens/s and ratio to HF.

And the single-stream weight-bandwidth floor: one decode step of one stream reads every
weight once (linear layers, the LM head, norms), so ``copy bandwidth / model bytes`` bounds
its tokens/s, with the bandwidth of a large tensor copy measured in the same run. Goals
(issue 13): the batch at >= 80% of its matmul floor, one stream at >= 85% of its
bandwidth floor. Since a decode step only reads its weights, the same floor against a
large read-only stream is printed too, with the single stream's share of it; both
bandwidths are the best of several passes, the median beside them (see bench.micro.bandwidth).

``--tp N`` splits the model over N ranks (processes; on the CPU they share its cores, so
this checks tensor parallelism end to end rather than speeding anything up). The matmul
floor is skipped there: rank 0's row-parallel layers cannot run without the other ranks;
so are both floors and the goals. ``--kv-cache-dtype`` is the server flag (a bf16 KV
pool on the CPU: docs/weights.md).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from bench.micro.bandwidth import copy_bandwidth, read_bandwidth
from engine import Engine, EngineConfig, SamplingParams
from engine.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES
from engine.layers.linear import FusedLinear


def make_workload(
    n: int,
    seed: int,
    vocab: tuple[int, int],
    prompt_lens: tuple[int, int],
    output_lens: tuple[int, int],
) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(*vocab) for _ in range(rng.randint(*prompt_lens))] for _ in range(n)]
    out_lens = [rng.randint(*output_lens) for _ in range(n)]
    return prompts, out_lens


def run_engine(
    engine: Engine,
    prompts: list[list[int]],
    out_lens: list[int],
    shapes: list[tuple[int, int]] | None = None,
) -> float:
    """Output tokens/s; appends (tokens forwarded, logit rows) per step to ``shapes``."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in out_lens]
    engine.flush_cache()
    with contextlib.ExitStack() as stack:
        if shapes is not None:
            for field, name in enumerate(("forward", "compute_logits")):
                wrap = partial(_recording, shapes=shapes, field=field)
                stack.enter_context(_patched(engine.model, name, wrap))
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == out_lens
    return sum(out_lens) / elapsed


_UNSET = object()


@contextlib.contextmanager
def _patched(obj: Any, name: str, wrap: Callable[[Any], Any]) -> Iterator[None]:
    """Within the block, ``obj.name`` is ``wrap(original)`` (an instance attribute; afterwards
    the instance's own attribute is put back, or removed so the class's method shows)."""
    own = obj.__dict__.get(name, _UNSET)
    setattr(obj, name, wrap(getattr(obj, name)))
    try:
        yield
    finally:
        if own is _UNSET:
            obj.__dict__.pop(name, None)
        else:
            setattr(obj, name, own)


def _recording(fn: Any, shapes: list[tuple[int, int]], field: int) -> Any:
    """Wrap forward (field 0: a new step, its token count) or compute_logits (field 1)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rows = int(args[0].shape[0])
        if field == 0:
            shapes.append((rows, 0))
        else:
            shapes[-1] = (shapes[-1][0], rows)
        return fn(*args, **kwargs)

    return wrapper


def matmul_floor(model: Any, shapes: list[tuple[int, int]], repeats: int = 3) -> float:
    """Seconds the model's linear layers alone take over the recorded step shapes (best
    of ``repeats``): attention, norms, sampling and scheduling cost nothing here."""
    linears = [
        m for name, m in model.named_modules() if isinstance(m, FusedLinear) and name != "lm_head"
    ]
    hidden = int(model.config.hidden_size)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for tokens, logit_rows in shapes:
            for linear in linears:
                linear.forward(torch.zeros(tokens, linear.in_features))
            if logit_rows:
                model.compute_logits(torch.zeros(logit_rows, hidden))
        best = min(best, time.perf_counter() - start)
    return best


def step_weight_tensors(model: Any) -> list[torch.Tensor]:
    """The weights one decode step of one stream reads, in the model's order: each linear
    layer's (its GGUF blocks when kept packed, else its dense weight) and bias, the norms
    and the LM head (the embedding table for a tied, unpacked model); not the embedding
    lookup (one row).

    NOTE: a weight held only in oneDNN's packed layout (``FusedLinear.pack_for_cpu``
    leaves ``weight`` empty) cannot be read from Python; it is listed as a meta tensor of
    its shape and dtype (no memory), so its bytes count; a reader of the list makes a
    dense stand-in for it.
    """
    tensors: list[torch.Tensor] = []
    for module in model.modules():
        if not isinstance(module, FusedLinear):
            continue
        if module.packed is not None:
            tensors += [part.data for _, part in module.packed.segments]
        elif module.weight.numel():
            tensors.append(module.weight)
        else:
            shape = (module.out_features, module.in_features)
            tensors.append(torch.empty(shape, dtype=module.weight.dtype, device="meta"))
        if module.bias is not None:
            tensors.append(module.bias)
    tensors += [param for name, param in model.named_parameters() if "norm" in name]
    if getattr(model, "lm_head", None) is None:  # tied, and not packed: the table itself
        tensors.append(model.model.embed_tokens)
    return tensors


def weight_bytes_per_token(model: Any) -> int:
    """Bytes of the weights one decode step of one stream reads (step_weight_tensors)."""
    return sum(t.numel() * t.element_size() for t in step_weight_tensors(model))


def run_hf(model: Any, prompts: list[list[int]], out_lens: list[int], pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max(out_lens),
            min_new_tokens=max(out_lens),
            do_sample=False,
            pad_token_id=pad_id,
        )
    return sum(out_lens) / (time.perf_counter() - start)


def step_overhead(engine: Engine, prompts: list[list[int]], steps: int = 40) -> tuple[float, float]:
    """Mean step time and the part of it spent outside the model forward (decode steps)."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    loop = engine.loop  # overlapped or plain, as the engine drives its steps
    while (
        any(r.kv_len < r.seq_len - 1 or not r.output_ids for r in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        loop.step()
    forward_time = 0.0

    def timing(original: Any) -> Any:
        def timed_forward(*args: Any, **kwargs: Any) -> Any:
            nonlocal forward_time
            t = time.perf_counter()
            result = original(*args, **kwargs)
            forward_time += time.perf_counter() - t
            return result

        return timed_forward

    with _patched(engine.model, "forward", timing):
        start = time.perf_counter()
        for _ in range(steps):
            loop.step()
        total = time.perf_counter() - start
    while loop.has_work:
        loop.step()
    return total / steps, (total - forward_time) / steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument(
        "--prompt-len",
        type=int,
        nargs=2,
        default=(8, 64),
        metavar=("MIN", "MAX"),
        help="prompt length range in tokens",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        default=(16, 128),
        metavar=("MIN", "MAX"),
        help="output length range in tokens",
    )
    parser.add_argument("--single-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true", help="only measure the engine")
    parser.add_argument(
        "--disable-mixed-batches",
        action="store_true",
        help="alternate prefill and decode steps (the server flag of the same name)",
    )
    parser.add_argument(
        "--disable-overlap-schedule",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the server flag: unset, overlapped on cuda/musa only; --no-... forces it on",
    )
    parser.add_argument(
        "--attention-backend", default="auto", choices=ATTENTION_BACKENDS, help="engine attention"
    )
    parser.add_argument("--device", default="cpu", help="engine device (cpu, cuda, musa:0, ...)")
    parser.add_argument(
        "--prefill-step-budget-ms",
        type=float,
        default=None,
        help="the server flag (unset: off, only the token limits)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="the server flag (bfloat16: a bf16 KV pool on the CPU)",
    )
    parser.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tp",
        type=int,
        default=1,
        help="tensor-parallel ranks (one device each)",
    )
    args = parser.parse_args(argv)

    torch.set_grad_enabled(False)
    engine = Engine(
        EngineConfig(
            model=args.model,
            device=args.device,
            dtype="float32",
            kv_cache_tokens=32768,
            max_running_requests=64,
            enable_prefix_cache=False,
            attention_backend=args.attention_backend,
            enable_mixed_batches=False if args.disable_mixed_batches else None,
            tensor_parallel_size=args.tp,
            disable_overlap_schedule=args.disable_overlap_schedule,
            prefill_step_budget_ms=args.prefill_step_budget_ms,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    )
    try:
        _measure(engine, args)
    finally:
        engine.close()  # stops the tensor-parallel workers


def _measure(engine: Engine, args: argparse.Namespace) -> None:
    prompts, out_lens = make_workload(
        args.num_requests, args.seed, (100, 40000), tuple(args.prompt_len), tuple(args.output_len)
    )
    print(
        f"{args.num_requests} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]} "
        f"tokens, outputs {args.output_len[0]}-{args.output_len[1]} tokens, greedy, fp32, "
        f"{engine.health()['kv_cache_dtype']} KV, "
        f"{engine.attention_backend} attention, tp {args.tp} on {engine.device_spec}, "
        f"overlapped scheduling {'on' if engine.overlap else 'off'}"
    )
    run_engine(engine, prompts[:2], [4, 4])  # warm-up
    shapes: list[tuple[int, int]] = []
    engine_batch = run_engine(engine, prompts, out_lens, shapes)
    engine_single = run_engine(engine, prompts[:1], [args.single_tokens])
    step_s, overhead_s = step_overhead(engine, prompts)
    print(f"engine  batch of {args.num_requests}: {engine_batch:8.1f} output tok/s")
    bound = None
    if args.tp == 1:  # rank 0 alone holds only its shard: no floor under TP
        floor_s = matmul_floor(engine.model, shapes)
        bound = sum(out_lens) / floor_s
        print(
            f"matmul floor of that run ({len(shapes)} forwards, linear layers only): "
            f"{floor_s:.2f} s = {bound:.1f} output tok/s at most"
        )
    print(f"engine  single stream:   {engine_single:8.1f} output tok/s")
    if bound is not None:
        model_bytes = weight_bytes_per_token(engine.model)
        copy, read = copy_bandwidth(), read_bandwidth()
        single_bound, read_bound = copy.best / model_bytes, read.best / model_bytes
        print(
            f"bandwidth floor of one stream: {model_bytes / 1e6:.1f} MB of weights per token, "
            f"large-copy bandwidth {copy.best / 1e9:.2f} GB/s (median {copy.median / 1e9:.2f})"
            f" = {single_bound:.1f} output tok/s at most"
        )
        # A decode step only reads its weights: the read-only stream is its real ceiling.
        print(
            f"read-only floor of one stream: read bandwidth {read.best / 1e9:.2f} GB/s (median "
            f"{read.median / 1e9:.2f}) = {read_bound:.1f} output tok/s at most; single stream "
            f"at {100 * engine_single / read_bound:.0f}% of it"
        )
        print(
            f"goals   batch {100 * engine_batch / bound:.0f}% of the matmul floor (goal >= "
            f"80%), single stream {100 * engine_single / single_bound:.0f}% of the bandwidth "
            f"floor (goal >= 85%)"
        )
    print(
        f"engine  decode step at {args.num_requests} running: {step_s * 1e3:.1f} ms, "
        f"of which outside the forward {overhead_s * 1e3:.2f} ms "
        f"({100 * overhead_s / step_s:.1f}%)"
    )
    if args.skip_hf:
        return
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32).eval()
    pad = engine.tokenizer.pad_token_id or 0
    hf_batch = run_hf(hf, prompts, out_lens, pad)
    hf_single = run_hf(hf, prompts[:1], [args.single_tokens], pad)
    print(f"HF      batch of {args.num_requests}: {hf_batch:8.1f} output tok/s")
    print(f"HF      single stream:   {hf_single:8.1f} output tok/s")
    print(f"ratio   batch {engine_batch / hf_batch:.2f}x, single {engine_single / hf_single:.2f}x")
    if bound is not None:
        print(f"bound   batch ratio with zero non-matmul cost: {bound / hf_batch:.2f}x")


if __name__ == "__main__":
    main()
