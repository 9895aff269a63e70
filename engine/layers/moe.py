"""Mixture-of-experts feed-forward: a router picks top-k experts per token, each a gated
MLP; plain PyTorch (one matmul pair per expert that received tokens), correct on every
device, and on GPUs where Triton runs the grouped kernels of
engine/layers/triton_ops/fused_moe.py. Used by Mixtral and Qwen3-MoE."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from engine.layers.linear import ALL_SHARDS, FusedLinear, activation_fn

# Without the Triton kernels, steps of at most this many tokens on an accelerator route
# on the device, with no host sync (decode, graph-capturable); each expert then computes
# a block of this many rows, so past it (prefill) the per-expert loop's one sync per
# layer is the cheaper cost. With them (fused_experts) every step routes on the device.
DEVICE_ROUTING_MAX_TOKENS = 256

# Checkpoint projection names (Mixtral w1/w3/w2, Qwen gate/up/down) -> half of w13 or w2.
EXPERT_PROJ = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": None, "down_proj": None}


def routes_on_device(device_type: str, num_tokens: int) -> bool:
    """Whether a step of ``num_tokens`` tokens takes the sync-free grouped path: on an
    accelerator, up to DEVICE_ROUTING_MAX_TOKENS (the CPU has no device to wait for)."""
    return device_type != "cpu" and num_tokens <= DEVICE_ROUTING_MAX_TOKENS


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
        self.activation = activation
        self.act = activation_fn(activation)
        # (x, w13, w2, experts, weights) -> out: the Triton grouped kernels, set by
        # triton_ops.fused.use_triton_fused_ops for SwiGLU experts on a GPU; None: PyTorch.
        self.fused_experts: Callable[..., torch.Tensor] | None = None
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
        if self.fused_experts is not None:
            out = self.fused_experts(x, self.w13, self.w2, experts, weights)
        elif routes_on_device(x.device.type, x.shape[0]):
            out = self.grouped_on_device(x, experts, weights)
        else:
            out = self.per_expert(x, experts, weights)
        if self.output_reduce is not None:
            out = self.output_reduce(out)
        return out

    def grouped_on_device(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Sort-and-group with shapes fixed by ``T`` alone, so nothing is read on the host:
        assignments sorted by expert, each expert's run gathered into a block of ``T`` rows
        (an expert gets each token at most once), two batched matmuls over all experts,
        one weighted scatter-add back. [T, hidden] -> [T, hidden]"""
        num_tokens, top_k = experts.shape
        flat = experts.reshape(-1)  # [T * k]
        order = torch.argsort(flat, stable=True)  # [T * k] assignments grouped by expert
        # NOTE: not torch.bincount, which reads the largest value on the host on CUDA.
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
        starts = torch.cumsum(counts, 0) - counts  # [E] first sorted assignment per expert
        rows = torch.arange(num_tokens, device=x.device)  # [T]
        valid = rows[None, :] < counts[:, None]  # [E, T]
        # NOTE: invalid rows point at assignment 0 and get weight 0: computed, dropped.
        picked = order[(starts[:, None] + rows[None, :]).masked_fill(~valid, 0)]  # [E, T]
        token_idx = picked // top_k  # [E, T]
        gate_weight = weights.reshape(-1)[picked] * valid  # [E, T]
        tokens = x[token_idx]  # [E, T, hidden]
        gate_up = torch.bmm(tokens, self.w13.transpose(1, 2))  # [E, T, 2 * intermediate]
        size = self.intermediate_size
        hidden = self.act(gate_up[..., :size]) * gate_up[..., size:]  # [E, T, intermediate]
        expert_out = torch.bmm(hidden, self.w2.transpose(1, 2))  # [E, T, hidden]
        expert_out = expert_out * gate_weight[..., None].to(expert_out.dtype)
        out = torch.zeros_like(x)
        out.index_add_(0, token_idx.reshape(-1), expert_out.reshape(-1, x.shape[1]))
        return out

    def per_expert(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """One matmul pair per expert that received tokens. [T, hidden] -> [T, hidden]"""
        out = torch.zeros_like(x)
        size = self.intermediate_size
        # NOTE: .tolist() syncs with the device once per layer (large steps only on a GPU).
        for expert in torch.unique(experts).tolist():
            token_idx, k_pos = torch.where(experts == expert)  # [n], [n]
            tokens = x[token_idx]  # [n, hidden]
            gate_up = tokens @ self.w13[expert].t()  # [n, 2 * intermediate]
            hidden = self.act(gate_up[:, :size]) * gate_up[:, size:]  # [n, intermediate]
            expert_out = hidden @ self.w2[expert].t()  # [n, hidden]
            out.index_add_(0, token_idx, expert_out * weights[token_idx, k_pos, None])
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
