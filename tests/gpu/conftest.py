"""GPU device check fixtures: tiny random-weight models around tests/gpu/tokenizer/, and
the figures the report prints. Refuses to run (collecting is fine) without CUDA."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

TOKENIZER_DIR = Path(__file__).resolve().parent / "tokenizer"
VOCAB = 384  # tests/gpu/tokenizer/tokenizer.json
REPORT_ENV = "HISERVE_DEVICE_REPORT"


def pytest_configure(config: pytest.Config) -> None:
    if config.option.collectonly:
        return
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise pytest.UsageError(
            f"no CUDA device is visible (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}); the GPU tests run only on a CUDA machine: make device-check"
        )


def make_model(path: Path, **overrides: Any) -> Path:
    """Save a random-weight Llama with the tiny tokenizer. Large initial weights make the
    logits peaked, so greedy tokens are not decided by rounding noise."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    config = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    config.update(overrides)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 100M parameters: big enough that decode timings mean something."""
    return make_model(
        tmp_path_factory.mktemp("small-llama"),
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        initializer_range=0.02,
    )


class Figures:
    """Measurements for the device check's report: one JSON object per line."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def add(self, name: str, value: float | int | str | bool, unit: str = "") -> None:
        print(f"[figure] {name} = {value} {unit}".rstrip())
        if self.path:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"name": name, "value": value, "unit": unit}) + "\n")


@pytest.fixture(scope="session")
def figures() -> Figures:
    return Figures(os.environ.get(REPORT_ENV))


def forbidding_syncs(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with any host sync on CUDA raising an error."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn(*args, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
