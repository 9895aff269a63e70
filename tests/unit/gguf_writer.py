"""Write a HF model to a GGUF file the way llama.cpp's converter lays it out (names from
the ``gguf`` package's own tensor map, float32 data), with the tokenizer metadata of the
default model's GGUF: what a user's GGUF of a new family looks like to hiserve."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from bench.synthetic_gguf import copy_tokenizer

# HF model_type -> GGUF architecture.
GGUF_ARCH = {
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "llama": gguf.MODEL_ARCH.LLAMA,
}
# GGUF tensor name -> ggml type to store it in, or None for float32.
QuantChoice = Callable[[str], "int | None"]


def _metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    head_dim = int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    writer.add_rope_freq_base(float(theta))
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "num_experts", None):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)


def _add(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: int | None) -> None:
    from tests.unit.quant_blocks import random_blocks

    if qtype is None or data.ndim != 2:
        writer.add_tensor(name, np.ascontiguousarray(data))
        return
    rows, cols = data.shape
    kind = gguf.GGMLQuantizationType(qtype)
    try:
        blocks = gguf.quants.quantize(np.ascontiguousarray(data), kind)
    except NotImplementedError:  # the K-quants: random blocks (the reference is the GGUF)
        blocks = random_blocks(qtype, rows, cols, seed=len(name))
    writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)


def write_gguf(
    model: torch.nn.Module, path: Path, tokenizer_gguf: Path, quant: QuantChoice | None = None
) -> Path:
    """``model`` as a GGUF file at ``path``; ``quant`` picks a ggml type per tensor (the
    K-quants, which gguf-py cannot quantize, get random blocks instead of the weights).
    Llama q/k rows are written as HF holds them, not permuted as llama.cpp does."""
    config: Any = model.config
    arch = GGUF_ARCH[config.model_type]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _metadata(writer, config)
    copy_tokenizer(writer, tokenizer_gguf)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    gemma = config.model_type.startswith("gemma")
    for hf_name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if hf_name.endswith("mlp.experts.gate_up_proj"):  # [E, 2 I, H] -> gate, up halves
            block = hf_name.split(".")[2]
            gate, up = np.split(data, 2, axis=1)
            writer.add_tensor(f"blk.{block}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
            writer.add_tensor(f"blk.{block}.ffn_up_exps.weight", np.ascontiguousarray(up))
            continue
        if hf_name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            writer.add_tensor(f"blk.{hf_name.split('.')[2]}.ffn_down_exps.weight", data)
            continue
        if hf_name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise KeyError(f"no GGUF name for {hf_name}")
        if gemma and "norm" in base:
            data = data + 1.0  # llama.cpp stores Gemma's norms as 1 + weight
        name = f"{gguf_name}.{suffix}"
        _add(writer, name, data, quant(name) if quant is not None else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
