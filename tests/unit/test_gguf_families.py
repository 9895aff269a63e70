"""GGUF files of the new families load through hiserve with HF's greedy output.

Each tiny random-weight model is written to GGUF as llama.cpp lays it out
(tests/unit/gguf_writer.py), converted by hiserve (transformers' GGUF reader underneath)
and compared with the original HF model. transformers reads GGUF for Qwen3, Qwen3-MoE,
Gemma 2, Gemma 3 and Phi-3. It takes fields GGUF does not carry from its config defaults,
so the configs keep those at the defaults: Qwen3's head_dim (128), Qwen3-MoE's
moe_intermediate_size (768) and norm_topk_prob (True), Gemma's query_pre_attn_scalar
(256). Mixtral GGUFs are
llama.cpp's ``llama`` architecture with expert tensors, which transformers loads as a
dense Llama, so Mixtral is not covered (serve it from safetensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config, Qwen3Config, Qwen3MoeConfig

from engine import loader
from engine.loader import default_gguf_path, load_hf_config, load_model, resolve_model_path
from tests.unit.gguf_writer import write_gguf
from tests.unit.hf_reference import assert_batched_greedy_matches_hf, random_hf_model
from tests.unit.model_configs import TOKENIZER_SIZED
from tests.unit.test_loader import _no_conversion

MAX_NEW_TOKENS = 6
# The tokenizer copied from the default model's GGUF, whose pad token is its EOS.
_COMMON: dict[str, Any] = {**TOKENIZER_SIZED, "pad_token_id": 2}
CASES = {
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=128, tie_word_embeddings=False),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **_COMMON,
        head_dim=16,
        moe_intermediate_size=768,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,  # what transformers' GGUF reader sets (as in the real models)
        tie_word_embeddings=False,
    ),
    "gemma2": lambda: Gemma2Config(**_COMMON, head_dim=16, sliding_window=8),
    "gemma3": lambda: Gemma3TextConfig(**_COMMON, head_dim=16, sliding_window=8),
    "phi3": lambda: Phi3Config(**_COMMON, tie_word_embeddings=False),
}


@pytest.mark.slow  # 20-35 s each on a shared 2-core box: the GGUF tokenizer conversion
@pytest.mark.parametrize("name", sorted(CASES))
def test_gguf_of_a_family_matches_hf(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = CASES[name]()
    hf_model = random_hf_model(config, seed=3)
    gguf_path = write_gguf(hf_model, tmp_path / f"{name}.gguf", default_gguf_path())

    model_dir = resolve_model_path(str(gguf_path), cache_dir=str(tmp_path / "cache"))
    assert load_hf_config(model_dir).model_type == config.model_type
    model = load_model(model_dir, torch.device("cpu"), torch.float32, attention_backend="torch")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (4, 13)]
    assert_batched_greedy_matches_hf(hf_model, model, prompts, MAX_NEW_TOKENS)
    if name == "qwen3_moe":
        # A family converted in one piece (stacked experts) still gives a complete
        # packed layout, reused by the next start, and the same model from it.
        cache = str(tmp_path / "cache")
        packed_dir = resolve_model_path(str(gguf_path), cache_dir=cache, packed=True)
        with monkeypatch.context() as patch:
            patch.setattr(loader, "convert_gguf_isolated", _no_conversion)
            assert resolve_model_path(str(gguf_path), cache_dir=cache, packed=True) == packed_dir
        packed = load_model(
            packed_dir, torch.device("cpu"), torch.float32, "torch", gguf_path=gguf_path
        )
        assert_batched_greedy_matches_hf(hf_model, packed, prompts, MAX_NEW_TOKENS)
