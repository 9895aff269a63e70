"""Gemma 2 and Gemma 3 (text): the Llama skeleton with Gemma's own pieces.

- RMSNorm scales by ``1 + weight`` (computed in float32), and every block norms four
  times: before and after attention, before and after the MLP (sandwich norms).
- Embeddings are multiplied by ``sqrt(hidden_size)``; the MLP is GeGLU (tanh GELU).
- Attention scores are scaled by ``query_pre_attn_scalar ** -0.5``; Gemma 2 soft-caps them
  (``attn_logit_softcapping``) and the final logits (``final_logit_softcapping``).
- Layers alternate local (sliding-window) and global attention per ``layer_types``;
  Gemma 3 gives each kind its own RoPE base and adds per-head q/k norms.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from engine.kvcache.device_pool import DeviceKVPool
from engine.layers.attention import AttentionBackend
from engine.layers.attention_meta import AttentionMetadata
from engine.layers.linear import GatedMLP
from engine.layers.rmsnorm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, read_rope_params
from engine.models.layer_attention import FULL, SLIDING, layer_backends, layer_types
from engine.models.llama import LlamaAttention, LlamaForCausalLM, head_dim_of
from engine.models.qwen3 import Qwen3Attention


class GemmaRMSNorm(RMSNorm):
    """``x / rms(x) * (1 + weight)``, all in float32, cast back to the input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [N, dim] or [T, heads, dim] -> same shape
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(Qwen3Attention):
    """Qwen3's per-head q and k norms before RoPE, as Gemma-style RMSNorms."""

    qk_norm_cls = GemmaRMSNorm


class GemmaDecoderLayer(nn.Module):
    """Sandwich-norm block: ``h + post_norm(attn(pre_norm(h)))``, then the same for the MLP.

    Called as LlamaDecoderLayer is: the residual stream ``h`` arrives as the previous
    block's output plus ``residual``, and the MLP's normed output leaves unadded (the
    next layer, or the final norm, adds it).
    """

    def __init__(self, hf_config: Any, layer_id: int, attn_backend: AttentionBackend) -> None:
        super().__init__()
        hidden, eps = int(hf_config.hidden_size), float(hf_config.rms_norm_eps)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        is_gemma3 = hf_config.model_type == "gemma3_text"
        attention_cls = Gemma3Attention if is_gemma3 else LlamaAttention
        self.self_attn = attention_cls(hf_config, layer_id, attn_backend)
        self.mlp = GatedMLP(
            hidden,
            int(hf_config.intermediate_size),
            activation=str(getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"),
        )

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]: previous block's output (not yet added)
        residual: torch.Tensor | None,  # [T, hidden]; None for the first layer
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_pool: DeviceKVPool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = hidden if residual is None else hidden + residual  # [T, hidden]
        attn = self.self_attn.forward(self.input_layernorm.forward(stream), cos, sin, meta, kv_pool)
        stream = stream + self.post_attention_layernorm.forward(attn)
        mlp = self.mlp.forward(self.pre_feedforward_layernorm.forward(stream))
        return self.post_feedforward_layernorm.forward(mlp), stream


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 (``gemma2``) and Gemma 3 text (``gemma3_text``) causal LMs."""

    decoder_layer_cls = GemmaDecoderLayer

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend | None = None) -> None:
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError(
                "Gemma with use_bidirectional_attention=True is an encoder, not a causal "
                "LM; hiserve serves causal Gemma models only"
            )
        super().__init__(hf_config, attn_backend)
        hidden = int(hf_config.hidden_size)
        self.model.norm = GemmaRMSNorm(hidden, float(hf_config.rms_norm_eps))
        self.embed_scale = hidden**0.5
        self.final_softcap: float | None = getattr(hf_config, "final_logit_softcapping", None)
        self.kinds = layer_types(hf_config)
        self.rotaries = self._rotaries(hf_config)
        self.rotary = self.rotaries[FULL]

    def _rotaries(self, hf_config: Any) -> dict[str, RotaryEmbedding]:
        """RoPE per layer kind: Gemma 3 keys ``rope_parameters`` by kind, Gemma 2 has one."""
        head_dim = head_dim_of(hf_config)
        params = getattr(hf_config, "rope_parameters", None) or {}
        if isinstance(params.get(FULL), dict):
            return {
                kind: RotaryEmbedding(
                    head_dim, read_rope_params(SimpleNamespace(rope_parameters=params[kind]))
                )
                for kind in (FULL, SLIDING)
            }
        shared = RotaryEmbedding(head_dim, read_rope_params(hf_config))
        return {FULL: shared, SLIDING: shared}

    def layer_backends(self, hf_config: Any) -> list[AttentionBackend]:
        # HF's Gemma 3 does not pass attn_logit_softcapping to attention; Gemma 2 does.
        softcap = getattr(hf_config, "attn_logit_softcapping", None)
        if hf_config.model_type != "gemma2":
            softcap = None
        scale = float(hf_config.query_pre_attn_scalar) ** -0.5
        return layer_backends(hf_config, self.attn_backend, softcap=softcap, scale=scale)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().embed(input_ids)  # [T, hidden]
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)

    def layer_cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        # kind -> ([T, 1, head_dim], [T, 1, head_dim]); each layer takes its kind's pair.
        cos_sin = {kind: rotary.cos_sin(positions, dtype) for kind, rotary in self.rotaries.items()}
        return [cos_sin[kind] for kind in self.kinds]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` float32 logits, soft-capped when configured."""
        logits = super().compute_logits(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
