"""Mixed batches against alternating steps on a GPU, engine only (no HTTP: the GPU
machine has no web stack), for the record of issue #15 (not a test).

    python3 tests/gpu/profile_mixed.py [--rate 8] [--pairs 2] [--device cuda]

A random-weight model of SmolLM2-135M's shape (fewer layers), bf16; the random workload
of ``bench.mixed`` with Poisson arrivals; then the decode-only step at the mixed run's
typical batch. ``--device cpu --layers 2`` is a dry run on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.compare import LaunchOptions  # noqa: E402
from bench.mixed import decode_step_ms, engine_run  # noqa: E402
from bench.workloads import WorkloadConfig, generate  # noqa: E402
from tests.gpu.conftest import make_model  # noqa: E402

SHAPE = dict(  # SmolLM2-135M's widths and vocabulary
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    initializer_range=0.02,
)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="decode-only step batch")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    workload = generate(
        WorkloadConfig(
            workload="random",
            seed=0,
            num_prompts=args.num_prompts,
            input_len=128,
            output_len=32,
            range_ratio=0.5,
        )
    )
    with tempfile.TemporaryDirectory() as scratch:
        model = make_model(Path(scratch) / "m", num_hidden_layers=args.layers, **SHAPE)
        launch = LaunchOptions(
            model=str(model), device=args.device, dtype=args.dtype, kv_cache_tokens=32768
        )
        engine_run(launch, True, workload, args.rate, 1)  # warm-up: kernels, allocator
        print(
            f"{args.layers}-layer SmolLM2-135M shape, {args.dtype} on {args.device}; "
            f"{args.num_prompts} prompts of 64-192 tokens, 32 output tokens, Poisson {args.rate}/s"
        )
        for _ in range(args.pairs):
            for mode, mixed in (("mixed", True), ("alternating", False)):
                tok_s, itl = engine_run(launch, mixed, workload, args.rate, 0)
                print(f"{mode:<12} {tok_s:8.1f} output tok/s, median ITL {itl:6.1f} ms")
        step = decode_step_ms(launch, args.batch, 128, 30, 0)
        print(f"decode-only step at {args.batch} running: {step:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
