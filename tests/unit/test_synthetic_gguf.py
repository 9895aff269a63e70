"""bench/synthetic_gguf.py's tiny shape through the engine's normal GGUF path: the file
gguf-py reads back as finite Q4_K weights, the engine keeps every linear layer and the
embedding packed (no float32 weight for them) and greedy decoding runs on it."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from bench.offline import step_weight_tensors
from bench.synthetic_gguf import SHAPES, check_q4_k, q4_k_blocks, write_synthetic_gguf
from engine import Engine, EngineConfig, SamplingParams
from engine.layers.linear import FusedLinear
from engine.loader import default_gguf_path

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_q4_k_blocks_dequantize_to_small_finite_weights() -> None:
    blocks = q4_k_blocks(8, 512, np.random.default_rng(0))
    assert blocks.shape == (8, 2 * 144) and blocks.dtype == np.uint8
    check_q4_k(blocks, 512)
    weights = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K)
    assert 0.005 < float(weights.std()) < 0.1
    assert abs(float(weights.mean())) < 0.01


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synthetic")
    return write_synthetic_gguf(out / "tiny.gguf", SHAPES["tiny"], default_gguf_path())


def test_the_file_holds_the_tiny_llama_in_q4_k(tiny_gguf: Path) -> None:
    shape = SHAPES["tiny"]
    reader = gguf.GGUFReader(str(tiny_gguf))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert len(types) == 1 + 9 * shape.layers + 1
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.Q4_K
    assert types["blk.1.ffn_down.weight"] == gguf.GGMLQuantizationType.Q4_K
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert "output.weight" not in types  # tied, as Llama-3.2-3B
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert np.isfinite(weights).all(), tensor.name


@pytest.mark.slow  # ~28 s on 2 cores, most of it transformers' GGUF tokenizer conversion
@torch.inference_mode()
def test_the_engine_keeps_it_packed_and_decodes(
    tiny_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = EngineConfig(
        model=str(tiny_gguf),
        device="cpu",
        cache_dir=str(tmp_path / "cache"),
        kv_cache_tokens=256,
        max_running_requests=2,
    )
    with caplog.at_level(logging.INFO, logger="engine.models.gguf_packed"):
        engine = Engine(config)
    try:
        assert engine.weights.packed_gguf
        linears = 4 * SHAPES["tiny"].layers + 1  # qkv, o, gate_up, down; the tied LM head
        tensors = 7 * SHAPES["tiny"].layers + 1  # q, k, v, o, gate, up, down; embedding
        assert f"GGUF weights kept packed: {tensors} tensors (Q4_K x{tensors})" in caplog.text
        model = engine.model
        packed = [m for m in model.modules() if isinstance(m, FusedLinear)]
        assert len(packed) == linears
        assert all(m.packed is not None and m.weight.numel() == 0 for m in packed)
        assert model.lm_head.packed is model.packed_embedding is not None  # shared blocks
        dense = {n: p.shape for n, p in model.named_parameters() if p.numel() and p.dim() > 1}
        assert dense == {}  # only norms (1D) are float32
        # bench.weights' read ceiling reads the packed blocks themselves, each once
        tensors = step_weight_tensors(model)
        blocks = {p.data.data_ptr() for m in packed for _, p in m.packed.segments}
        assert blocks <= {t.data_ptr() for t in tensors} and not any(t.is_meta for t in tensors)
        out = engine.generate(
            [[1, 2, 3, 4, 5]], [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)]
        )
        assert len(out[0].token_ids) == 4
        assert all(0 <= t < 49152 for t in out[0].token_ids)
    finally:
        engine.close()
