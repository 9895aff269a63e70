"""Mixture-of-experts feed-forward: a router picks top-k experts per token, each a gated
MLP; plain PyTorch (one matmul pair per expert that received tokens), correct on every
device. Used by Mixtral and Qwen3-MoE."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from engine.layers.linear import ALL_SHARDS, FusedLinear, activation_fn

# Checkpoint projection names (Mixtral w1/w3/w2, Qwen gate/up/down) -> half of w13 or w2.
EXPERT_PROJ = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": None, "down_proj": None}


class SparseMoE(nn.Module):
    """``sum_k weight_k * expert_k(x)`` over the top-k experts of the router's softmax.

    ``renormalize``: divide the top-k probabilities by their sum (Mixtral always;
    Qwen3-MoE when ``norm_topk_prob``).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..{num_experts}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.intermediate_size = intermediate_size
        self.act = activation_fn(activation)
        # Tensor parallelism: each rank holds a slice of every expert's intermediate
        # size, so the output is a partial sum that this all-reduce completes.
        self.output_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.gate = FusedLinear(hidden_size, [num_experts])  # the router
        # gate and up rows stacked per expert: [E, 2 * intermediate, hidden]
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        # [E, hidden, intermediate]
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids ``[T, k]`` and their weights ``[T, k]`` (in ``x.dtype``)."""
        probs = torch.softmax(self.gate.forward(x).float(), dim=-1)  # [T, E] float32
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, hidden] -> [T, hidden]
        experts, weights = self.route(x)
        out = torch.zeros_like(x)
        size = self.intermediate_size
        # NOTE: .tolist() syncs with the device once per layer; the grouped path is the
        # place to remove it where it measures faster.
        for expert in torch.unique(experts).tolist():
            token_idx, k_pos = torch.where(experts == expert)  # [n], [n]
            tokens = x[token_idx]  # [n, hidden]
            gate_up = tokens @ self.w13[expert].t()  # [n, 2 * intermediate]
            hidden = self.act(gate_up[:, :size]) * gate_up[:, size:]  # [n, intermediate]
            expert_out = hidden @ self.w2[expert].t()  # [n, hidden]
            out.index_add_(0, token_idx, expert_out * weights[token_idx, k_pos, None])
        if self.output_reduce is not None:
            out = self.output_reduce(out)
        return out

    # ---- weights: see engine/models/weights.py -----------------------------------------

    def shard_keys(self, kind: str) -> list[Hashable]:
        if kind == "w13":
            return [(e, half) for e in range(self.num_experts) for half in (0, 1)]
        return list(range(self.num_experts))

    def load_param(self, kind: str, shard: Any, weight: torch.Tensor) -> None:
        """``kind`` w13: ``shard`` is ``(expert, half)`` (0 gate, 1 up); w2: ``expert``;
        ``ALL_SHARDS``: a checkpoint tensor that stacks every expert already."""
        param = self.w13 if kind == "w13" else self.w2
        if kind not in ("w13", "w2"):
            raise ValueError(f"SparseMoE has no parameter {kind!r}")
        if shard == ALL_SHARDS:
            self._copy(param, weight)
        elif kind == "w13":
            expert, half = shard
            size = self.intermediate_size
            self._copy(self.w13[expert, half * size : (half + 1) * size], weight)
        else:
            self._copy(self.w2[shard], weight)

    @staticmethod
    def _copy(target: torch.Tensor, weight: torch.Tensor) -> None:
        if tuple(target.shape) != tuple(weight.shape):
            raise ValueError(
                f"expert weight shape {tuple(weight.shape)} != expected {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(weight)
