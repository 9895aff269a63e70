"""The native GEMV kernel against oneDNN's packed GEMM and ``F.linear``, per layer shape.

    python -m bench.micro.gemv [--model default] [--tokens 1 2 4 8] [--rounds 7] [--threads N]
                         [--working-set-mib 256]

For each linear shape of the model (q/k/v, o, gate/up, down, the LM head) and each token
count: microseconds per call and GB/s of weights read for the kernel, oneDNN packed and
``F.linear``, alternated round by round (so a busy neighbour hurts all three alike), best
and median of the rounds; then the kernel's share of the read bandwidth measured in the
same run, and the sum over one decode forward (layers x shapes + LM head).

Each call reads a different copy of the weight, cycling over enough copies (at least
``--working-set-mib`` of them) that they cannot sit in the L3 cache, as a decode step
reads each layer's weights once; the read bandwidth streams twice that.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from bench.micro.bandwidth import read_bandwidth
from engine.layers import gemv_cpu
from engine.layers.linear import _PACK_BATCH_HINT
from engine.loader import load_hf_config, resolve_model_path
from engine.models.llama import head_dim_of


class Shape(NamedTuple):
    name: str
    out_features: int  # N
    in_features: int  # K
    per_forward: int  # calls in one decode forward


def model_shapes(config: Any) -> list[Shape]:
    """The linear shapes of a Llama-like model, as FusedLinear stacks them."""
    hidden, inter = int(config.hidden_size), int(config.intermediate_size)
    layers, heads = int(config.num_hidden_layers), int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = head_dim_of(config)
    return [
        Shape("qkv", (heads + 2 * kv_heads) * head_dim, hidden, layers),
        Shape("o", hidden, heads * head_dim, layers),
        Shape("gate_up", 2 * inter, hidden, layers),
        Shape("down", hidden, inter, layers),
        Shape("lm_head", int(config.vocab_size), hidden, 1),
    ]


def _cycling(calls: list[Callable[[], object]]) -> Callable[[], object]:
    state = {"i": 0}

    def call() -> object:
        state["i"] = (state["i"] + 1) % len(calls)
        return calls[state["i"]]()

    return call


def measure_shape(
    shape: Shape, tokens: int, kernel: Any, rounds: int, working_set: int = 256 * 2**20
) -> dict[str, tuple[float, float]]:
    """Seconds per call, (best, median) over ``rounds``, for gemv, onednn and f_linear;
    each cycles over ``working_set`` bytes of weights (default: 8x a 32 MiB L3)."""
    nbytes = shape.out_features * shape.in_features * 4
    copies = max(2, -(-working_set // nbytes))
    weights = [torch.randn(shape.out_features, shape.in_features) for _ in range(copies)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT) for w in weights]
    x = torch.randn(tokens, shape.in_features)

    def gemv(w: torch.Tensor) -> Callable[[], object]:
        return lambda: kernel.gemv(x, w, None)

    def onednn(p: torch.Tensor) -> Callable[[], object]:
        return lambda: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

    def f_linear(w: torch.Tensor) -> Callable[[], object]:
        return lambda: F.linear(x, w)

    variants = {
        "gemv": _cycling([gemv(w) for w in weights]),
        "onednn": _cycling([onednn(p) for p in packed]),
        "f_linear": _cycling([f_linear(w) for w in weights]),
    }
    # At least one pass over the copies, and ~64 MiB read per round.
    calls = copies * max(1, min(64 * 2**20, 4 * working_set) // (copies * nbytes))
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls)
    return {name: (min(t), statistics.median(t)) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument(
        "--working-set-mib", type=int, default=256, help="weights each variant cycles over"
    )
    args = parser.parse_args(argv)
    working_set = args.working_set_mib * 2**20
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = gemv_cpu.gemv_kernel()
    if kernel is None:
        raise SystemExit(f"the GEMV kernel cannot be built here: {gemv_cpu.build_error()}")
    shapes = model_shapes(load_hf_config(resolve_model_path(args.model)))
    read = read_bandwidth(megabytes=2 * args.working_set_mib)
    print(
        f"{args.model}, {torch.get_num_threads()} threads; read bandwidth {read.best / 1e9:.1f} "
        f"GB/s (median {read.median / 1e9:.1f}); per call: us (GB/s of weights), best of "
        f"{args.rounds} rounds [median]"
    )
    with torch.inference_mode():
        for tokens in args.tokens:
            forward = dict.fromkeys(("gemv", "onednn", "f_linear"), 0.0)
            for shape in shapes:
                got = measure_shape(shape, tokens, kernel, args.rounds, working_set)
                nbytes = shape.out_features * shape.in_features * 4
                cells = []
                for name, (best, median) in got.items():
                    forward[name] += best * shape.per_forward
                    cells.append(
                        f"{name} {best * 1e6:7.1f} ({nbytes / best / 1e9:5.1f}) "
                        f"[{median * 1e6:7.1f}]"
                    )
                share = nbytes / got["gemv"][0] / read.best
                print(
                    f"M={tokens} {shape.name:8s} {shape.out_features:5d}x{shape.in_features:<5d} "
                    + "  ".join(cells)
                    + f"  gemv {100 * share:3.0f}% of read"
                )
            print(
                f"M={tokens} one forward: gemv {forward['gemv'] * 1e3:.2f} ms, onednn "
                f"{forward['onednn'] * 1e3:.2f} ms, f_linear {forward['f_linear'] * 1e3:.2f} ms"
            )


if __name__ == "__main__":
    main()
