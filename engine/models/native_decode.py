"""A packed Llama-style model's pure decode steps as one native call per step.

At decode each ``LlamaDecoderLayer`` makes ~10 small native calls (RMSNorm, the packed
matmuls, RoPE, the K/V store, attention, SwiGLU) with ~25 Python-level tensor operations
between them: for the default model ~1.5 ms of a ~7 ms single-stream step.
``csrc/decode_layers.h`` runs the same kernels in the same order without the Python, so
the hidden states are the same bits (tests/unit/test_native_decode.py). Prefill and mixed
steps, and steps that wait for a host-tier load, keep the Python layers.

Only models whose layers are exactly the Llama decoder with every CPU kernel in place
qualify (``why_not`` names the first thing that does not): ``LlamaForCausalLM`` (Llama,
SmolLM, Qwen2, Mistral, Phi-3), float32 activations on the CPU, every linear layer packed
(GGUF blocks, or bf16 weights), the native attention kernel in every layer (no sliding
window), the fused RMSNorm / RoPE / SwiGLU kernels. ``HISERVE_CPU_NATIVE_DECODE=0`` turns
it off.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from engine.kvcache.device_pool import DeviceKVPool
from engine.layers.attention import CpuNativeAttentionBackend
from engine.layers.attention_meta import AttentionMetadata
from engine.layers.fused_cpu import fused_kernels
from engine.layers.linear import FusedLinear, GatedMLP
from engine.layers.quant_cpu import quant_kernel
from engine.layers.rmsnorm import RMSNorm
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)

ENV_SWITCH = "HISERVE_CPU_NATIVE_DECODE"


class NativeDecode:
    """``model.native_decode``: (embedded tokens, cos, sin, meta, pool) -> the final norm's
    output ``[B, hidden]`` for a pure decode step, through every layer in one call."""

    def __init__(self, layers: Any) -> None:
        self.layers = layers  # the native DecodeLayers

    def __call__(
        self,
        hidden: torch.Tensor,  # [B, hidden]
        cos: torch.Tensor,  # [B, 1, head_dim]
        sin: torch.Tensor,  # [B, 1, head_dim]
        meta: AttentionMetadata,
        kv_pool: DeviceKVPool,
    ) -> torch.Tensor:
        return self.layers.run(
            hidden,
            cos,
            sin,
            kv_pool.k_buffers,
            kv_pool.v_buffers,
            meta.out_slots,
            meta.req_table,
            meta.req_rows,
            meta.seq_lens,
        )


def why_not(model: nn.Module) -> str | None:
    """Why ``model``'s decode steps cannot run natively; None when they can."""
    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} is not the plain Llama decoder"
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype != torch.float32:
        return "only float32 activations on the CPU"
    fused = fused_kernels()
    if fused is None:
        return "the fused CPU kernels are unavailable"
    norms = [model.model.norm]
    for layer in model.model.layers:
        if type(layer) is not LlamaDecoderLayer or type(layer.self_attn) is not LlamaAttention:
            return f"layer type {type(layer).__name__}"
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn.attn_backend) is not CpuNativeAttentionBackend or attn.fused_rope_store:
            return f"attention backend {attn.attn_backend.name} (not the native CPU kernel)"
        if attn.rotary_fn is not fused.rotary:
            return "RoPE is not the fused CPU kernel"
        if type(mlp) is not GatedMLP or mlp.act_mul is not fused.silu_mul:
            return "the MLP is not the fused SwiGLU kernel"
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(type(lin) is not FusedLinear or lin.packed is None for lin in linears):
            return "a linear layer is not packed (a dense float32 weight)"
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
    if any(
        type(norm) is not RMSNorm or norm.fused_add_norm is not fused.add_rms_norm for norm in norms
    ):
        return "RMSNorm is not the fused CPU kernel"
    return None


def _linear(kernel: Any, linear: FusedLinear) -> Any:
    assert linear.packed is not None
    return linear.packed.native_linear(kernel, linear.bias)


def _norm(norm: RMSNorm) -> tuple[torch.Tensor, float]:
    return norm.weight.detach(), float(norm.eps)


def use_native_decode(model: nn.Module) -> bool:
    """Give a qualifying model its ``native_decode``; say why not at debug level (most
    models on most devices do not qualify, and that is no news)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    reason = why_not(model)
    kernel = quant_kernel() if reason is None else None
    if reason is None and kernel is None:
        reason = "the packed-weight kernel is unavailable"
    if reason is not None:
        logger.debug("decode steps run layer by layer in Python: %s", reason)
        return False
    assert isinstance(model, LlamaForCausalLM) and kernel is not None
    decoder: list[Any] = list(model.model.layers)
    q_heads = decoder[0].self_attn.q_heads if decoder else 0
    final_norm: Any = model.model.norm
    layers = kernel.DecodeLayers(q_heads, model.kv_heads, model.head_dim, _norm(final_norm))
    for layer in decoder:
        a, mlp = layer.self_attn, layer.mlp
        layers.add_layer(
            _norm(layer.input_layernorm),
            _norm(layer.post_attention_layernorm),
            _linear(kernel, a.qkv_proj),
            _linear(kernel, a.o_proj),
            _linear(kernel, mlp.gate_up_proj),
            _linear(kernel, mlp.down_proj),
        )
    model.native_decode = NativeDecode(layers)
    logger.info("decode steps of %d layers run as one native call", model.num_layers)
    return True
