"""Tiny model configurations the model tests share, and the prompts they run on.

``TINY`` sizes a model small enough to build, save and run against HF transformers in
well under a second; ``FAMILY_CASES`` are the non-Llama families at that size, with
windows of 6-7 tokens that prompts of a dozen tokens cross. ``TOKENIZER_SIZED`` is the
same model with the default model's vocabulary and special tokens, for tests that need a
real tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

# float32 engine against float32 HF: logits agree to this.
LOGIT_ATOL = 1e-4
LOGIT_RTOL = 1e-4

_DIMS: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
TINY: dict[str, Any] = dict(
    vocab_size=256,
    **_DIMS,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
TOKENIZER_SIZED: dict[str, Any] = dict(
    vocab_size=49152,  # the default model's tokenizer
    **_DIMS,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)

FAMILY_CASES: dict[str, Callable[[], Any]] = {
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=False),
    # Layer 0 full, layer 1 windowed (max_window_layers=1).
    "qwen3_window": lambda: Qwen3Config(
        **TINY,
        head_dim=32,
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    ),
    "mistral_window": lambda: MistralConfig(**TINY, sliding_window=6),
    "phi3_window": lambda: Phi3Config(**TINY, sliding_window=7),
    "gemma2": lambda: Gemma2Config(
        **TINY,
        head_dim=16,
        query_pre_attn_scalar=24,  # != head_dim: the scale must come from here
        sliding_window=6,
        attn_logit_softcapping=4.0,  # small, so capping changes the scores
        final_logit_softcapping=15.0,
    ),
    "gemma3": lambda: Gemma3TextConfig(
        **TINY,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),
    "mixtral_sharded": lambda: MixtralConfig(
        **TINY, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False
    ),
    # Layer 0 routed (without renormalising the top-k weights), layer 1 dense.
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **TINY,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
}


def random_prompts(lengths: Sequence[int], seed: int = 7, vocab_size: int = 256) -> list[list[int]]:
    """One prompt of uniformly random token ids per length, the same for every ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]
