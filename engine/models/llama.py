"""Llama-family decoder (Llama, SmolLM, Qwen2, Mistral, Phi-3) over the paged KV pool.

The other families (Qwen3, Gemma, the MoE models) subclass these classes and override the
hooks: ``norm_qk`` (per-head q/k norms), ``make_mlp`` (experts), ``decoder_layer_cls``,
``embed`` and ``layer_cos_sin`` (Gemma's scaled embeddings and per-layer RoPE).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.kvcache.device_pool import DeviceKVPool
from engine.layers.attention import AttentionBackend, get_attention_backend
from engine.layers.attention_meta import AttentionMetadata
from engine.layers.linear import ALL_SHARDS, FusedLinear, GatedMLP
from engine.layers.quant_cpu import PackedWeight, QuantTensor
from engine.layers.rmsnorm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary, read_rope_params
from engine.models.layer_attention import layer_backends
from engine.models.weights import load_named_weights

# HF name inside a layer -> (our module path, shard index)
STACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", 0),
    "self_attn.o_proj": ("self_attn.o_proj", 0),
    # Phi-3 checkpoints store q/k/v and gate/up already fused.
    "self_attn.qkv_proj": ("self_attn.qkv_proj", ALL_SHARDS),
    "mlp.gate_up_proj": ("mlp.gate_up_proj", ALL_SHARDS),
}
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def head_dim_of(hf_config: Any) -> int:
    """``head_dim`` from the config when set, else ``hidden_size // num_attention_heads``."""
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim or hf_config.hidden_size // hf_config.num_attention_heads)


class LlamaAttention(nn.Module):
    """Fused QKV projection, RoPE, paged attention through the backend, output projection."""

    def __init__(self, hf_config: Any, layer_id: int, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.q_heads = int(hf_config.num_attention_heads)
        self.kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or self.q_heads)
        self.head_dim = head_dim_of(hf_config)
        if self.q_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads={self.q_heads} is not a multiple of "
                f"num_key_value_heads={self.kv_heads}"
            )
        hidden = int(hf_config.hidden_size)
        is_qwen2 = getattr(hf_config, "model_type", "") == "qwen2"
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        # Qwen2 always has q/k/v bias and never an o_proj bias; Llama's attention_bias
        # covers all four projections.
        qkv_bias = attention_bias or is_qwen2
        o_bias = attention_bias and not is_qwen2
        q_size, kv_size = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(hidden, [q_size, kv_size, kv_size], bias=qkv_bias)
        self.o_proj = FusedLinear(q_size, [hidden], bias=o_bias)
        self.attn_backend = attn_backend
        # (x [T, H, D], cos, sin) -> rotated x; the fused CPU kernel replaces it on float32
        # CPU models (fused_cpu.use_fused_cpu_kernels).
        self.rotary_fn = apply_rotary
        # Set by triton_ops.fused.use_triton_fused_ops where the backend does RoPE and the
        # K/V store in one kernel (rope_forward); False: rotate here, the backend stores.
        self.fused_rope_store = False

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,  # [T, 1, head_dim]
        meta: AttentionMetadata,
        kv_pool: DeviceKVPool,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qk_heads = self.q_heads + self.kv_heads
        # [T, q_heads + 2 * kv_heads, head_dim]
        qkv = self.qkv_proj.forward(hidden).view(
            num_tokens, qk_heads + self.kv_heads, self.head_dim
        )
        # [T, q_heads + kv_heads, head_dim]
        if self.fused_rope_store:
            attn = self.attn_backend.rope_forward(
                self.norm_qk(qkv[:, :qk_heads]), qkv[:, qk_heads:], cos, sin,
                self.layer_id, meta, kv_pool,
            )  # fmt: skip
            return self.o_proj.forward(attn)
        qk = self.rotary_fn(self.norm_qk(qkv[:, :qk_heads]), cos, sin)
        attn = self.attn_backend.forward(
            qk[:, : self.q_heads],  # [T, q_heads, head_dim]
            qk[:, self.q_heads :],  # [T, kv_heads, head_dim]
            qkv[:, qk_heads:],  # [T, kv_heads, head_dim]
            self.layer_id,
            meta,
            kv_pool,
        )  # [T, q_heads * head_dim]
        return self.o_proj.forward(attn)

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """Hook before RoPE on ``[T, q_heads + kv_heads, head_dim]``; Llama has none."""
        return qk


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: attention then SwiGLU MLP, residual carried between layers."""

    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, hf_config: Any, layer_id: int, attn_backend: AttentionBackend) -> None:
        super().__init__()
        eps = float(hf_config.rms_norm_eps)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps)
        self.self_attn = self.attention_cls(hf_config, layer_id, attn_backend)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps)
        self.mlp = self.make_mlp(hf_config, layer_id)

    def make_mlp(self, hf_config: Any, layer_id: int) -> nn.Module:
        """The feed-forward of layer ``layer_id`` (``forward(x [T, hidden]) -> [T, hidden]``)."""
        return GatedMLP(
            hf_config.hidden_size,
            hf_config.intermediate_size,
            bias=bool(getattr(hf_config, "mlp_bias", False)),
        )

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]: previous block's output (not yet added)
        residual: torch.Tensor | None,  # [T, hidden]; None for the first layer
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_pool: DeviceKVPool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            normed = self.input_layernorm.forward(hidden)
        else:
            normed, residual = self.input_layernorm.add_forward(hidden, residual)
        attn_out = self.self_attn.forward(normed, cos, sin, meta, kv_pool)
        normed, residual = self.post_attention_layernorm.add_forward(attn_out, residual)
        return self.mlp.forward(normed), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(
        self, hf_config: Any, layer_cls: type[nn.Module], backends: list[AttentionBackend]
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Parameter(
            torch.empty(hf_config.vocab_size, hf_config.hidden_size), requires_grad=False
        )
        self.layers = nn.ModuleList(
            layer_cls(hf_config, i, backend) for i, backend in enumerate(backends)
        )
        self.norm = RMSNorm(hf_config.hidden_size, float(hf_config.rms_norm_eps))


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a flattened batch of new tokens and a paged KV pool."""

    decoder_layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = hf_config
        self.attn_backend = attn_backend or get_attention_backend("torch")
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.num_layers = int(hf_config.num_hidden_layers)
        self.head_dim = head_dim_of(hf_config)
        self.kv_heads = int(
            getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        )
        self.vocab_size = int(hf_config.vocab_size)
        self.model = LlamaModel(hf_config, self.decoder_layer_cls, self.layer_backends(hf_config))
        self.rotary = RotaryEmbedding(self.head_dim, read_rope_params(hf_config))
        # Untied models own an lm_head; tied ones multiply by the embedding table (on CPU
        # pack_for_cpu may add a packed copy of it).
        self.lm_head: FusedLinear | None = (
            None
            if self.tie_word_embeddings
            else FusedLinear(hf_config.hidden_size, [self.vocab_size])
        )
        # The embedding table as GGUF blocks (use_packed_embedding), None when dense.
        self.packed_embedding: PackedWeight | None = None
        # (hidden, cos, sin, meta, kv_pool) -> the final norm's output: a pure decode step
        # through every layer in one native call; set by native_decode.use_native_decode
        # on qualifying packed CPU models, None everywhere else.
        self.native_decode: Callable[..., torch.Tensor] | None = None

    def layer_backends(self, hf_config: Any) -> list[AttentionBackend]:
        """Attention per layer: the shared backend, windowed where the config asks."""
        return layer_backends(hf_config, self.attn_backend)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_pool: DeviceKVPool,
    ) -> torch.Tensor:  # [T, hidden] after the final norm
        hidden = self.embed(input_ids)  # [T, hidden]
        if self.native_decode is not None and meta.is_decode and not meta.kv_loads:
            cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
            return self.native_decode(hidden, cos, sin, meta, kv_pool)
        rope = self.layer_cos_sin(positions, hidden.dtype)
        residual: torch.Tensor | None = None
        # NOTE: submodules are called through .forward, not __call__: the hook machinery
        # costs microseconds per call, and a decode step makes ~300 such calls.
        for layer, (cos, sin) in zip(self.model.layers, rope):
            hidden, residual = layer.forward(hidden, residual, cos, sin, meta, kv_pool)
        if residual is None:  # a model without layers
            return self.model.norm.forward(hidden)
        return self.model.norm.add_forward(hidden, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Hook: ``[T]`` token ids -> ``[T, hidden]``, the first layer's input."""
        if self.packed_embedding is not None:
            return self.packed_embedding.rows_float(input_ids).to(self.model.embed_tokens.dtype)
        return F.embedding(input_ids, self.model.embed_tokens)

    def layer_cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        """Hook: RoPE ``(cos, sin)`` for each layer in turn, each ``[T, 1, head_dim]``;
        computed once per forward and shared by every layer here."""
        return itertools.repeat(self.rotary.cos_sin(positions, dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` float32 logits."""
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens).float()
        return self.lm_head(hidden).float()

    # ---- weights -------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantTensor]]) -> None:
        """Copy HF-named tensors into the fused parameters; raise on missing or unknown names."""
        load_named_weights(self, weights, self.map_name)

    def map_name(self, name: str) -> tuple[str, Any] | None:
        """HF name -> (our parameter name, shard index); None for names to skip."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "model.embed_tokens.weight":
            return "model.embed_tokens", 0
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: the embedding is the output projection
        match = LAYER_NAME.match(name)
        if match:
            layer, sub, kind = match.groups()
            if sub in STACKED:
                module, shard = STACKED[sub]
                return f"model.layers.{layer}.{module}.{kind}", shard
        return name, 0

    def tied_head(self) -> FusedLinear:
        """A tied model's LM head as a layer over the embedding table (shared, not copied),
        for the CPU fast paths (oneDNN packing, the GEMV kernel) to take over."""
        embed = self.model.embed_tokens
        if self.packed_embedding is not None:
            with torch.device("meta"):  # its dense weight is never allocated
                head = FusedLinear(self.packed_embedding.in_features, [self.vocab_size])
            head.weight = nn.Parameter(embed.detach(), requires_grad=False)  # the placeholder
            head.packed = self.packed_embedding
            return head
        head = FusedLinear(embed.shape[1], [embed.shape[0]])
        head.weight = nn.Parameter(embed.detach(), requires_grad=False)
        return head

    def use_packed_embedding(self) -> PackedWeight:
        """Keep the embedding table as GGUF blocks (filled by ``load_packed_param``); after
        loading, a tied model's ``tied_head`` multiplies by the same blocks. Call before
        memory is allocated."""
        dense = self.model.embed_tokens
        self.packed_embedding = PackedWeight(self.vocab_size, int(dense.shape[1]))
        self.model.embed_tokens = nn.Parameter(
            torch.empty(0, dtype=dense.dtype, device=dense.device), requires_grad=False
        )
        return self.packed_embedding

    def load_packed_param(self, param_name: str, tensor: QuantTensor) -> bool:
        """The loader's entry for GGUF blocks of a plain parameter: True if taken."""
        if param_name != "model.embed_tokens" or self.packed_embedding is None:
            return False
        self.packed_embedding.put(0, tensor)
        return True

    def pack_for_cpu(self, second_copies: bool = True) -> int:
        """Switch every linear layer to oneDNN-packed weights (CPU only); returns how many.
        ``second_copies`` False: the layers the GEMV kernel reads dense stay unpacked
        (``FusedLinear.pack_for_cpu``).

        Call once after load_weights. A tied model gets a packed copy of the embedding as
        its lm_head (the lookup still needs the dense table).
        """
        if self.lm_head is None:
            head = self.tied_head()
            if head.pack_for_cpu(second_copies):
                self.lm_head = head
        linears = [m for m in self.modules() if isinstance(m, FusedLinear)]
        return sum(int(m.pack_for_cpu(second_copies)) for m in linears)
