"""Weight formats side by side: float32, bfloat16 and the GGUF blocks kept packed.

One run loads the model once per format (float32 and bf16 dense, dequantized from the GGUF
at load; packed: the GGUF's own blocks, float32 activations) and measures, for each, a
single stream and a batch of 32 through the engine (greedy, ``ignore_eos``), then the
bytes of weights one decode step reads against the read-only bandwidth measured in the
same run (bench/micro/bandwidth.py): the single stream's share of its own floor.

    python -m bench.weights [--model default] [--single-tokens 128] [--formats ...]
"""

from __future__ import annotations

import argparse
import gc
from typing import NamedTuple

import torch

from bench.micro.bandwidth import read_bandwidth
from bench.offline import make_workload, run_engine, weight_bytes_per_token
from engine import Engine, EngineConfig

# Format name -> the engine's --dtype for it (packed: auto on a GGUF, see dtypes.py).
FORMATS = {"float32": "float32", "bf16": "bfloat16", "packed": "auto"}


class FormatResult(NamedTuple):
    name: str
    single: float  # output tokens/s, one stream
    batch: float  # output tokens/s, batch of ``batch_size``
    bytes_per_token: int  # weights one decode step reads


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
        single = max(
            run_engine(engine, prompts[:1], [args.single_tokens]) for _ in range(args.repeats)
        )
        return FormatResult(name, single, batch, weight_bytes_per_token(engine.model))
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
