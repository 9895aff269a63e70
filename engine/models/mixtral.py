"""Mixtral: the Llama decoder with a sparse mixture of experts in place of the MLP; also
the expert weight names every MoE family here shares."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from engine.layers.linear import ALL_SHARDS
from engine.layers.moe import EXPERT_PROJ, SparseMoE
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM

# Hub checkpoints: one tensor per expert and projection (Mixtral's block_sparse_moe.*.w1/
# w2/w3, Qwen's mlp.experts.*.gate_proj/up_proj/down_proj).
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$"
)
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight$")
# transformers 5 state dicts (what a GGUF conversion writes): experts already stacked.
_STACKED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def map_expert_name(name: str) -> tuple[str, Any] | None:
    """An MoE checkpoint name -> (our parameter, shard); None if ``name`` is no MoE tensor."""
    if match := _EXPERT.match(name):
        layer, expert, proj = match.groups()
        if proj not in EXPERT_PROJ:
            raise ValueError(f"{name}: unknown expert projection {proj!r}")
        half = EXPERT_PROJ[proj]
        if half is None:
            return f"model.layers.{layer}.mlp.w2", int(expert)
        return f"model.layers.{layer}.mlp.w13", (int(expert), half)
    if match := _ROUTER.match(name):
        return f"model.layers.{match.group(1)}.mlp.gate.weight", 0
    if match := _STACKED_EXPERTS.match(name):
        layer, proj = match.groups()
        return f"model.layers.{layer}.mlp.{'w13' if proj == 'gate_up_proj' else 'w2'}", ALL_SHARDS
    return None


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, hf_config: Any, layer_id: int) -> nn.Module:
        # Mixtral renormalises the top-k router probabilities to sum to one.
        return SparseMoE(
            hf_config.hidden_size,
            hf_config.intermediate_size,
            num_experts=int(hf_config.num_local_experts),
            top_k=int(hf_config.num_experts_per_tok),
            renormalize=True,
            activation=str(getattr(hf_config, "hidden_act", "silu")),
        )


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: every layer's feed-forward is a top-k routed set of SwiGLU experts."""

    decoder_layer_cls = MixtralDecoderLayer

    def map_name(self, name: str) -> tuple[str, Any] | None:
        return map_expert_name(name) or super().map_name(name)
