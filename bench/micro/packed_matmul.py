"""The packed kernel's batch path (engine/layers/csrc/quant_amx.h on CPUs with AMX) at
prefill sizes: milliseconds and TFLOPS per weight shape, beside torch's own bf16 matmul.

    python -m bench.micro.packed_matmul [--types BF16 Q4_1] [--tokens 4096] [--rounds 5]
                                        [--shapes 960x576 576x576 3072x576 576x1536]
                                        [--swiglu 3072x576]

The default shapes are one layer of the default model (SmolLM2-135M: q/k/v, o, gate/up,
down), summed on each type's last line. A last line per type times the gate/up weight
(``--swiglu``, 2I x K) with SwiGLU applied apart (``qmatmul``, then the fused kernels'
``silu_mul``) and in the product's own pass (``qmatmul_swiglu``, AMX only), and another
the whole MLP (with a down weight of the same type, K x I): that pass then the down
product, against ``qmatmul_swiglu_down``, whose SwiGLU result goes into the down
product's token tiles instead of memory. ``torch bf16`` is ``F.linear`` on bf16 tokens and
weights (oneDNN, bf16 out): one tile product per value where hiserve's float32 tokens
take two (quant_amx.h), so it is a scale to read the figures against, not the same sum.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.micro.packed_gemv import random_weight
from engine.layers.quant_cpu import PACKED_TYPES, quant_kernel

DEFAULT_SHAPES = ["960x576", "576x576", "3072x576", "576x1536"]


def best_seconds(fn: Callable[[], Any], rounds: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def time_shape(
    kernel: Any, qtype: int, n: int, k: int, tokens: int, rounds: int
) -> tuple[float, float]:
    """Best seconds of ``qmatmul`` and of torch's bf16 ``F.linear`` on one shape."""
    gen = torch.Generator().manual_seed(n * k + qtype)
    dense = torch.randn(n, k, generator=gen).bfloat16()
    if PACKED_TYPES[qtype][0] == "BF16":
        weight = dense.view(torch.uint8).reshape(n, -1).contiguous()
    else:
        weight = random_weight(qtype, n, k, gen)
    x, out = torch.randn(tokens, k, generator=gen), torch.empty(tokens, n)
    ours = best_seconds(lambda: kernel.qmatmul(x, weight, qtype, out), rounds)
    x16 = x.bfloat16()
    theirs = best_seconds(lambda: F.linear(x16, dense), rounds)
    return ours, theirs


def time_swiglu(
    kernel: Any, qtype: int, n: int, k: int, tokens: int, rounds: int
) -> tuple[float, float | None]:
    """Best seconds of a [gate; up] product then ``silu_mul``, and of ``qmatmul_swiglu``
    (None where it does not take the AMX path)."""
    from engine.layers.fused_cpu import fused_kernels

    fused = fused_kernels()
    if fused is None:
        raise SystemExit("the fused CPU kernels are not available here (HISERVE_CPU_FUSED=0?)")
    gen = torch.Generator().manual_seed(n * k + qtype)
    if PACKED_TYPES[qtype][0] == "BF16":
        weight = torch.randn(n, k, generator=gen).bfloat16().view(torch.uint8).reshape(n, -1)
    else:
        weight = random_weight(qtype, n, k, gen)
    x = torch.randn(tokens, k, generator=gen)
    product, out = torch.empty(tokens, n), torch.empty(tokens, n // 2)

    def apart() -> None:
        kernel.qmatmul(x, weight, qtype, product)
        fused.silu_mul(product)

    if not kernel.qmatmul_swiglu(x, weight, qtype, out):
        return best_seconds(apart, rounds), None
    one_pass = best_seconds(lambda: kernel.qmatmul_swiglu(x, weight, qtype, out), rounds)
    return best_seconds(apart, rounds), one_pass


def time_mlp(
    kernel: Any, qtype: int, n: int, k: int, tokens: int, rounds: int
) -> tuple[float, float] | None:
    """Best seconds of ``qmatmul_swiglu`` then the down product (``[k, n / 2]``), and of
    ``qmatmul_swiglu_down``; None where that does not take the AMX path or I is not a
    whole number of the type's blocks."""
    if (n // 2) % PACKED_TYPES[qtype][1]:
        return None
    gen = torch.Generator().manual_seed(n * k + qtype + 1)

    def weight(rows: int, cols: int) -> torch.Tensor:
        if PACKED_TYPES[qtype][0] == "BF16":
            return (
                torch.randn(rows, cols, generator=gen)
                .bfloat16()
                .view(torch.uint8)
                .reshape(rows, -1)
            )
        return random_weight(qtype, rows, cols, gen)

    gate_up, down = weight(n, k), weight(k, n // 2)
    x = torch.randn(tokens, k, generator=gen)
    hidden, out = torch.empty(tokens, n // 2), torch.empty(tokens, k)
    if not kernel.qmatmul_swiglu_down(x, gate_up, qtype, down, qtype, out):
        return None

    def apart() -> None:
        kernel.qmatmul_swiglu(x, gate_up, qtype, hidden)
        kernel.qmatmul(hidden, down, qtype, out)

    tiles = best_seconds(
        lambda: kernel.qmatmul_swiglu_down(x, gate_up, qtype, down, qtype, out), rounds
    )
    return best_seconds(apart, rounds), tiles


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = {name: q for q, (name, _, _) in PACKED_TYPES.items()}
    parser.add_argument("--types", nargs="+", default=["BF16", "Q4_1"])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--swiglu", default="3072x576", help="a gate/up shape, 2I x K")
    args = parser.parse_args(argv)
    unknown = set(args.types) - set(names)
    if unknown:
        parser.error(f"unknown types {sorted(unknown)}; types: {sorted(names)}")
    if args.tokens <= 4:
        parser.error("--tokens must be over 4 (fewer take the register path: packed_gemv)")
    torch.set_grad_enabled(False)
    kernel = quant_kernel()
    if kernel is None:
        raise SystemExit("the packed CPU kernel is not available here (HISERVE_GGUF_PACKED=0?)")
    path = "AMX tiles" if kernel.AMX else f"no AMX ({kernel.ISA})"
    print(f"packed batch path ({path}), {args.tokens} tokens, best of {args.rounds}")
    print(f"{'type':6} {'N x K':>11} {'ms':>8} {'TFLOPS':>7} {'torch bf16 ms':>14}")
    for name in args.types:
        total = reference = 0.0
        for shape in args.shapes:
            n, k = (int(v) for v in shape.lower().split("x"))
            ours, theirs = time_shape(kernel, names[name], n, k, args.tokens, args.rounds)
            total, reference = total + ours, reference + theirs
            flops = 2 * n * k * args.tokens
            print(
                f"{name:6} {shape:>11} {ours * 1e3:8.2f} {flops / ours / 1e12:7.2f} "
                f"{theirs * 1e3:14.2f}"
            )
        print(f"{name:6} {'all':>11} {total * 1e3:8.2f} {'':>7} {reference * 1e3:14.2f}")
        n, k = (int(v) for v in args.swiglu.lower().split("x"))
        apart, one_pass = time_swiglu(kernel, names[name], n, k, args.tokens, args.rounds)
        fused = "not on this path" if one_pass is None else f"{one_pass * 1e3:.2f} ms"
        print(
            f"{name:6} {'SwiGLU':>11} {args.swiglu}: apart {apart * 1e3:.2f} ms, one pass {fused}"
        )
        mlp = time_mlp(kernel, names[name], n, k, args.tokens, args.rounds)
        through = "not on this path" if mlp is None else (
            f"SwiGLU then down {mlp[0] * 1e3:.2f} ms, through the tiles {mlp[1] * 1e3:.2f} ms"
        )  # fmt: skip
        print(f"{name:6} {'MLP':>11} {args.swiglu}: {through}")


if __name__ == "__main__":
    main()
