"""The fused CPU kernels against the PyTorch ops they replace, at a model's decode shapes.

    python -m bench.micro.fused_kernels [--model default] [--tokens 1 32 512] [--threads N]

For each token count: microseconds per call of RMSNorm with its residual add and of RoPE
on the strided q/k view, PyTorch then fused (alternated, best of several rounds, so a
busy neighbour hurts both alike), and what that adds up to per forward (two norms and one
RoPE per layer, plus the final norm).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.layers import fused_cpu
from engine.layers.rmsnorm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary, read_rope_params
from engine.loader import load_hf_config, resolve_model_path
from engine.models.llama import head_dim_of


def best_us(fn: Callable[[], object], calls: int, rounds: int = 7) -> float:
    """Best mean microseconds per call over ``rounds`` rounds of ``calls`` calls."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def measure(
    tokens: int, norm: RMSNorm, rotary: RotaryEmbedding, kernels: Any, heads: int, kv_heads: int
) -> tuple[float, float, float, float]:
    """Microseconds per call: add+rms_norm PyTorch, fused; RoPE PyTorch, fused."""
    hidden = norm.weight.shape[0]
    x, residual = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
    qkv = torch.randn(tokens, heads, rotary.head_dim)  # [T, q + 2 kv, head_dim]
    qk = qkv[:, : heads - kv_heads]  # the strided view the model rotates
    cos, sin = rotary.cos_sin(torch.arange(tokens), torch.float32)
    calls = max(20, 20000 // tokens)
    norm.fused_add_norm = None
    norm_ref = best_us(lambda: norm.add_forward(x, residual), calls)
    norm.fused_add_norm = kernels.add_rms_norm
    norm_fused = best_us(lambda: norm.add_forward(x, residual), calls)
    rope_ref = best_us(lambda: apply_rotary(qk, cos, sin), calls)
    rope_fused = best_us(lambda: kernels.rotary(qk, cos, sin), calls)
    return norm_ref, norm_fused, rope_ref, rope_fused


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = fused_cpu.fused_kernels()
    if kernels is None:
        raise SystemExit(f"the fused kernels cannot be built here: {fused_cpu.build_error()}")
    config = load_hf_config(resolve_model_path(args.model))
    hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
    q_heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or q_heads)
    head_dim = head_dim_of(config)
    norm = RMSNorm(hidden, float(config.rms_norm_eps))
    rotary = RotaryEmbedding(head_dim, read_rope_params(config))
    print(
        f"{args.model}: hidden {hidden}, {layers} layers, heads {q_heads}/{kv_heads}x{head_dim}, "
        f"{torch.get_num_threads()} threads; us per call, PyTorch -> fused"
    )
    with torch.inference_mode():
        for tokens in args.tokens:
            norm_ref, norm_fused, rope_ref, rope_fused = measure(
                tokens, norm, rotary, kernels, q_heads + 2 * kv_heads, kv_heads
            )
            per_forward_ref = (2 * layers + 1) * norm_ref + layers * rope_ref
            per_forward_fused = (2 * layers + 1) * norm_fused + layers * rope_fused
            print(
                f"{tokens:5d} tokens: add+rms_norm {norm_ref:8.1f} -> {norm_fused:8.1f}, "
                f"RoPE {rope_ref:8.1f} -> {rope_fused:8.1f}; per forward "
                f"{per_forward_ref / 1e3:.2f} -> {per_forward_fused / 1e3:.2f} ms"
            )


if __name__ == "__main__":
    main()
