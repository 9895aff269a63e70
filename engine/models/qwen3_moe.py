"""Qwen3-MoE: Qwen3 attention (q/k norms) with routed experts on the sparse layers."""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.layers.linear import GatedMLP
from engine.layers.moe import SparseMoE
from engine.models.mixtral import map_expert_name
from engine.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, hf_config: Any, layer_id: int) -> nn.Module:
        # Dense layers: those listed in mlp_only_layers, and all but every
        # decoder_sparse_step-th layer (as HF's Qwen3MoeDecoderLayer decides).
        num_experts = int(hf_config.num_experts)
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        dense_only = list(getattr(hf_config, "mlp_only_layers", None) or [])
        act = str(getattr(hf_config, "hidden_act", "silu"))
        if layer_id in dense_only or num_experts == 0 or (layer_id + 1) % step:
            return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, activation=act)
        return SparseMoE(
            hf_config.hidden_size,
            int(hf_config.moe_intermediate_size),
            num_experts=num_experts,
            top_k=int(hf_config.num_experts_per_tok),
            renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
            activation=act,
        )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE (no shared experts; router weights renormalised when norm_topk_prob)."""

    decoder_layer_cls = Qwen3MoeDecoderLayer

    def map_name(self, name: str) -> tuple[str, Any] | None:
        return map_expert_name(name) or super().map_name(name)
