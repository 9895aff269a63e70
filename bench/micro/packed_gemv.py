"""The packed register path (engine/layers/csrc/quant_cpu.cpp) reading its weights from
memory: GB/s of packed bytes per GGUF type and weight shape, at 1-4 tokens.

    python -m bench.micro.packed_gemv [--types Q4_1 Q4_K Q6_K Q8_0] [--shapes 3072x3072 3072x8192]
                                      [--tokens 1] [--working-set-mb 1024] [--rounds 3]

For each type and ``NxK`` shape it makes enough weights of random blocks (finite fp16
scales) to fill ``--working-set-mb``, multiplies ``--tokens`` tokens by each in turn (as
a decode step reads each layer's weights once) and prints the best round's packed bytes
per second, beside the read-only bandwidth measured in the same run.

NOTE: keep the working set well above the CPU's L3 (300 MiB on the 2-core AMX machine
these figures come from, shared with its neighbours): a model that fits there, like the
default one (97 MB packed), is read from the cache from the second token on, and its
single stream is then not bound by memory at all (docs/weights.md).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from bench.micro.bandwidth import read_bandwidth
from engine.layers.quant_cpu import PACKED_TYPES, quant_kernel

# Byte offsets of each type's fp16 fields in a block (the rest are quants: any byte goes).
_HALVES = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
_SCALE = np.array([0.01], dtype=np.float16).view(np.uint8)


def random_weight(qtype: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, row_bytes]`` uint8 of random blocks whose fp16 fields hold 0.01."""
    name, block, size = PACKED_TYPES[qtype]
    data = torch.randint(0, 256, (n, k // block, size), dtype=torch.uint8, generator=gen)
    for offset in _HALVES.get(name, ()):
        data[:, :, offset : offset + 2] = torch.from_numpy(_SCALE.copy())
    return data.reshape(n, -1).contiguous()


def bandwidth(
    kernel: Any, qtype: int, n: int, k: int, tokens: int, working_set: int, rounds: int
) -> float:
    """Best packed bytes/s over ``rounds`` passes through a working set of weights."""
    gen = torch.Generator().manual_seed(qtype)
    first = random_weight(qtype, n, k, gen)
    weights = [first] + [
        random_weight(qtype, n, k, gen) for _ in range(max(1, working_set // first.numel()) - 1)
    ]
    x, out = torch.randn(tokens, k, generator=gen), torch.empty(tokens, n)
    nbytes = sum(w.numel() for w in weights)
    best = float("inf")
    for _ in range(rounds + 1):  # the first pass warms up
        start = time.perf_counter()
        for w in weights:
            kernel.qmatmul(x, w, qtype, out)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = {name: q for q, (name, _, _) in PACKED_TYPES.items() if name != "BF16"}
    parser.add_argument("--types", nargs="+", default=["Q4_1", "Q4_K", "Q6_K", "Q8_0"])
    parser.add_argument("--shapes", nargs="+", default=["3072x3072", "3072x8192"])
    parser.add_argument("--tokens", type=int, default=1, choices=(1, 2, 3, 4))
    parser.add_argument("--working-set-mb", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    unknown = set(args.types) - set(names)
    if unknown:
        parser.error(f"unknown types {sorted(unknown)}; packed types: {sorted(names)}")
    torch.set_grad_enabled(False)
    kernel = quant_kernel()
    if kernel is None:
        raise SystemExit("the packed CPU kernel is not available here (HISERVE_GGUF_PACKED=0?)")
    read = read_bandwidth()
    print(
        f"packed register path ({kernel.ISA}), {args.tokens} token(s), working set "
        f"{args.working_set_mb} MB; read-only bandwidth {read.best / 1e9:.1f} GB/s"
    )
    print(f"{'type':6} {'N x K':>11} {'GB/s':>6} {'of read':>8}")
    for name in args.types:
        for shape in args.shapes:
            n, k = (int(v) for v in shape.lower().split("x"))
            working_set = args.working_set_mb << 20
            rate = bandwidth(kernel, names[name], n, k, args.tokens, working_set, args.rounds)
            print(f"{name:6} {shape:>11} {rate / 1e9:6.1f} {100 * rate / read.best:7.0f}%")


if __name__ == "__main__":
    main()
