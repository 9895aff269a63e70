"""The Triton MoE kernels (engine/layers/triton_ops/fused_moe.py) under Triton's interpreter:
the expert alignment's invariants, the grouped kernels against SparseMoE's per-expert
PyTorch loop, and tiny Mixtral and Qwen3-MoE models with them switched on against HF
transformers."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pathlib import Path

from engine.graph_setup import graph_blockers
from engine.layers.moe import SparseMoE
from engine.layers.triton_ops.fused import use_triton_fused_ops
from engine.layers.triton_ops.fused_moe import align_by_expert, fused_experts, max_blocks
from engine.loader import load_model
from tests.unit.hf_reference import assert_batched_greedy_matches_hf, random_hf_model
from tests.unit.model_configs import FAMILY_CASES, random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _moe(hidden: int, inter: int, experts: int, top_k: int, seed: int) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(hidden, inter, experts, top_k, renormalize=True)
    moe.gate.weight.data = torch.randn_like(moe.gate.weight)
    moe.w13.data = torch.randn_like(moe.w13) * 0.2
    moe.w2.data = torch.randn_like(moe.w2) * 0.2
    return moe


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "block_m"),
    [(1, 4, 2, 16), (7, 8, 2, 4), (40, 3, 1, 16), (33, 8, 8, 8), (0, 4, 2, 16)],
)
def test_alignment_puts_each_assignment_once_in_blocks_of_one_expert(
    tokens: int, experts: int, top_k: int, block_m: int
) -> None:
    gen = torch.Generator().manual_seed(tokens)
    rows = [torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]
    chosen = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)
    sorted_ids, block_expert = align_by_expert(chosen, experts, block_m)
    count = tokens * top_k
    blocks = max_blocks(count, experts, block_m)
    assert sorted_ids.shape == (blocks * block_m,) and block_expert.shape == (blocks,)
    real = sorted_ids[sorted_ids < count]
    assert sorted(real.tolist()) == list(range(count))  # each assignment exactly once
    flat = chosen.reshape(-1)
    for b in range(blocks):
        ids = sorted_ids[b * block_m : (b + 1) * block_m]
        ids = ids[ids < count]
        expert = int(block_expert[b])
        if expert == experts:  # past every run: no assignment
            assert ids.numel() == 0
        else:
            assert bool((flat[ids] == expert).all())


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k"),
    [(1, 32, 48, 4, 2), (5, 40, 24, 8, 2), (37, 64, 40, 4, 1), (20, 32, 32, 8, 8)],
)
def test_fused_experts_match_the_per_expert_loop(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int
) -> None:
    # Widths that are not multiples of the tiles, one token, every expert for each token.
    moe = _moe(hidden, inter, experts, top_k, seed=tokens)
    x = torch.randn(tokens, hidden)
    chosen, weights = moe.route(x)
    expected = moe.per_expert(x, chosen, weights)
    got = fused_experts(x, moe.w13, moe.w2, chosen, weights)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # The module takes the kernels once they are switched on.
    moe.fused_experts = fused_experts
    torch.testing.assert_close(moe(x), expected, atol=1e-5, rtol=1e-5)


def test_fused_experts_in_half_precision_and_empty_steps() -> None:
    moe = _moe(32, 48, 4, 2, seed=3)
    x = torch.randn(9, 32)
    chosen, weights = moe.route(x)
    expected = moe.per_expert(x, chosen, weights)
    got = fused_experts(
        x.bfloat16(), moe.w13.bfloat16(), moe.w2.bfloat16(), chosen, weights.bfloat16()
    )
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=5e-2, rtol=5e-2)
    empty = torch.zeros(0, 32)
    assert fused_experts(empty, moe.w13, moe.w2, chosen[:0], weights[:0]).shape == (0, 32)


@pytest.mark.parametrize("family", ["mixtral_sharded", "qwen3_moe"])
def test_tiny_moe_models_with_the_kernels_match_hf_greedy(family: str, tmp_path: Path) -> None:
    hf_model = random_hf_model(FAMILY_CASES[family](), seed=9)
    hf_model.save_pretrained(tmp_path)
    model = load_model(tmp_path, torch.device("cpu"), torch.float32)
    # Without the kernels, routing past DEVICE_ROUTING_MAX_TOKENS syncs the host, so
    # large steps cannot be captured; with them nothing is read on the host.
    assert any("mixture-of-experts" in r for r in graph_blockers(model, 1024))
    assert use_triton_fused_ops(model) > 0
    assert graph_blockers(model, 1024) == []
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert moes and all(m.fused_experts is fused_experts for m in moes)
    assert_batched_greedy_matches_hf(hf_model, model, random_prompts((4, 11)), 5)
