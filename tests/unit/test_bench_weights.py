"""The bytes-per-token count bench.offline and bench.weights share, on a tiny Llama in float32 and bf16 weights."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.offline import weight_bytes_per_token
from engine.layers.linear import FusedLinear
from engine.loader import load_model


def test_bf16_weights_halve_the_bytes_a_token_reads(tiny_llama_dir: Path) -> None:
    cpu = torch.device("cpu")
    dense = load_model(tiny_llama_dir, cpu, torch.float32, "torch")
    bf16 = load_model(tiny_llama_dir, cpu, torch.float32, "torch", bf16_weights=True)
    linears = [m for m in dense.modules() if isinstance(m, FusedLinear)]
    weights = sum(m.in_features * m.out_features for m in linears)
    norms = sum(p.numel() * 4 for name, p in dense.named_parameters() if "norm" in name)
    # Untied or tied, the LM head is one of the linear layers once use_cpu_gemv has run.
    assert weight_bytes_per_token(dense) == 4 * weights + norms
    assert weight_bytes_per_token(bf16) == 2 * weights + norms
    x = torch.randn(3, dense.config.hidden_size)
    got, want = bf16.compute_logits(x), dense.compute_logits(x)
    assert float((got - want).abs().max() / want.abs().max()) < 0.02  # bf16 rounding only
