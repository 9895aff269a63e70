"""Qwen3: the Llama decoder with an RMSNorm over each q and k head before RoPE."""

from __future__ import annotations

from typing import Any

import torch

from engine.layers.attention import AttentionBackend
from engine.layers.rmsnorm import RMSNorm
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    """LlamaAttention plus ``q_norm``/``k_norm`` (one ``[head_dim]`` weight each, shared by
    all heads)."""

    qk_norm_cls: type[RMSNorm] = RMSNorm  # Gemma 3 reuses this class with its own norm

    def __init__(self, hf_config: Any, layer_id: int, attn_backend: AttentionBackend) -> None:
        super().__init__(hf_config, layer_id, attn_backend)
        eps = float(hf_config.rms_norm_eps)
        self.q_norm = self.qk_norm_cls(self.head_dim, eps)
        self.k_norm = self.qk_norm_cls(self.head_dim, eps)

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        # [T, q_heads + kv_heads, head_dim]: RMSNorm runs over head_dim, per head.
        q = self.q_norm.forward(qk[:, : self.q_heads])
        k = self.k_norm.forward(qk[:, self.q_heads :])
        return torch.cat((q, k), dim=1)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models; sliding-window layers per ``layer_types`` when enabled."""

    decoder_layer_cls = Qwen3DecoderLayer
