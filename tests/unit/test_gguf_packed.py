"""GGUF weights kept packed against the same GGUF dequantized to float32 at load.

The default model (Q4_1, with a Q8_0 embedding that is also its tied LM head): greedy
tokens identical on the parity prompts, decoding one row (the kernel's 1-token path) and
three rows together; logits within ``LOGIT_REL_TOL`` of the largest logit. A tiny Llama
written to GGUF with every packed type (and Q5_0, which is not packed) checks the K-quants
end to end, the llama.cpp q/k row order being undone, and the log line naming what was
dequantized. Memory: no float32 copy of a packed weight exists after loading.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from engine.layers.linear import FusedLinear
from engine.loader import default_gguf_path, load_model, load_tokenizer, resolve_model_path
from tests.unit.gguf_writer import write_gguf
from tests.unit.hf_reference import random_hf_model
from tests.unit.model_configs import TOKENIZER_SIZED
from tests.unit.model_driver import GreedyDriver
from tests.unit.parity_prompts import parity_prompts

# Packed and dequantized float32 differ only in summation order: every logit within this
# fraction of the largest |logit| of its position.
LOGIT_REL_TOL = 1e-4
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs().amax(-1) / b.abs().amax(-1)).max())


def _dense_linear_bytes(model: torch.nn.Module) -> int:
    return sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, FusedLinear)
    )


@pytest.fixture(scope="module")
def default_pair(default_model_dir: Path) -> tuple[Any, Any]:
    """(packed, from the packed layout the server converts; dequantized float32) default
    model."""
    gguf_path = default_gguf_path()
    cpu = torch.device("cpu")
    packed_dir = resolve_model_path("default", packed=True)
    packed = load_model(packed_dir, cpu, torch.float32, "torch", gguf_path=gguf_path)
    dense = load_model(default_model_dir, cpu, torch.float32, "torch")
    return packed, dense


@pytest.mark.slow
@torch.inference_mode()
def test_default_model_packed_greedy_equals_dequantized(
    default_model_dir: Path, default_pair: tuple[Any, Any]
) -> None:
    packed, dense = default_pair
    assert packed.packed_embedding is not None and packed.lm_head.packed is not None
    assert packed.model.layers[0].mlp.gate_up_proj.packed.type_names() == ["Q4_1"]
    prompts = parity_prompts(load_tokenizer(default_model_dir))
    runs = {}
    for name, model in (("packed", packed), ("dense", dense)):
        driver = GreedyDriver(model, max_rows=4, max_context=160)
        together = driver.generate(prompts, 24)
        alone = driver.generate(prompts[:1], 24)
        runs[name] = (together, alone, driver.prefill_logits(prompts[2]))
    for got, want in zip(
        runs["packed"][0] + runs["packed"][1], runs["dense"][0] + runs["dense"][1]
    ):
        assert got.tokens == want.tokens
        assert _max_rel_diff(torch.stack(got.logits), torch.stack(want.logits)) < LOGIT_REL_TOL
    assert _max_rel_diff(runs["packed"][2], runs["dense"][2]) < LOGIT_REL_TOL


@pytest.mark.slow
def test_packed_default_model_holds_no_float32_copy(default_pair: tuple[Any, Any]) -> None:
    packed, dense = default_pair
    params = sum(p.numel() * p.element_size() for p in packed.parameters())
    assert params < 1_000_000  # norms only: every linear weight and the embedding are packed
    assert _dense_linear_bytes(packed) == 0
    packed_bytes = packed.packed_embedding.nbytes + sum(
        m.packed.nbytes for m in packed.modules() if isinstance(m, FusedLinear) and m.packed
    )
    # The tied head shares the embedding's blocks: counted once above, no second copy.
    assert packed.lm_head.packed is packed.packed_embedding
    packed_bytes -= packed.lm_head.packed.nbytes
    assert packed_bytes + params <= default_gguf_path().stat().st_size
    assert sum(p.numel() * 4 for p in dense.parameters()) > 5 * packed_bytes


@pytest.mark.slow
def test_bench_bytes_per_token_of_the_packed_model_are_the_gguf_tensor_bytes(
    default_pair: tuple[Any, Any],
) -> None:
    """Counted independently from the file: every GGUF tensor's bytes once (the tied
    embedding's blocks are the LM head a step reads; the lookup of one row is not counted).
    """
    import gguf

    from bench.offline import weight_bytes_per_token

    packed, _ = default_pair
    reader = gguf.GGUFReader(str(default_gguf_path()))
    assert weight_bytes_per_token(packed) == sum(int(t.n_bytes) for t in reader.tensors)


_RSS_SCRIPT = """
import sys, torch
from engine.loader import default_gguf_path, load_model

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

import engine.models.gguf_packed, transformers, safetensors.torch  # imports before the baseline
from engine.loader import resolve_model_path
packed = sys.argv[1] == "packed"
model_dir = resolve_model_path("default", packed=packed)
before = rss()
model = load_model(model_dir, torch.device("cpu"), torch.float32, "torch",
                   gguf_path=default_gguf_path() if packed else None)
print(rss() - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_packed_load_grows_resident_memory_by_the_packed_size() -> None:
    # Loose: the growth of RSS over the load, in a fresh process, is well under the
    # 538 MB float32 copy (the packed weights are ~96 MB; kernels and buffers add some).
    resolve_model_path("default", packed=True)  # converted here, not in the measured process
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, "packed"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    grown = int(out.stdout.strip().splitlines()[-1])
    assert grown < 300e6, f"RSS grew by {grown / 1e6:.0f} MB over a packed load"


def _quant_choice(name: str) -> int | None:
    """A ggml type per tensor: every packed type somewhere, Q5_0 (not packed) once."""
    if name == "token_embd.weight":
        return 8  # Q8_0, the tied head too
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if "attn_q" in name or "attn_k" in name:
        return 12 if layer == 0 else 2  # Q4_K, Q4_0 (both permuted by llama.cpp's order)
    if "attn_v" in name:
        return 14  # Q6_K next to Q4_K in one fused qkv layer
    if "attn_output" in name:
        return 6 if layer == 1 else 3  # Q5_0: dequantized at load; Q4_1
    if "ffn_up" in name and layer == 1:
        return 6  # Q5_0 beside a Q5_K gate: the fused gate/up layer stays dense
    if "ffn_gate" in name or "ffn_up" in name:
        return 13  # Q5_K
    if "ffn_down" in name:
        return 14 if layer == 0 else 8
    return None


@pytest.mark.slow  # the GGUF tokenizer conversion takes ~20 s
@torch.inference_mode()
def test_every_packed_type_in_a_tiny_llama_gguf(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dims = {**TOKENIZER_SIZED, "hidden_size": 256, "intermediate_size": 512, "pad_token_id": 2}
    config = LlamaConfig(**dims, head_dim=64, tie_word_embeddings=True)
    hf_model = random_hf_model(config, seed=11)
    gguf_path = write_gguf(hf_model, tmp_path / "tiny.gguf", default_gguf_path(), _quant_choice)
    cache = str(tmp_path / "cache")
    # The packed layout (what the server converts for packed weights: no dense copy of
    # the packable tensors) against the full float32 conversion.
    packed_dir = resolve_model_path(str(gguf_path), cache_dir=cache, packed=True)
    model_dir = resolve_model_path(str(gguf_path), cache_dir=cache)
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="engine.models.gguf_packed"):
        packed = load_model(packed_dir, cpu, torch.float32, "torch", gguf_path=gguf_path)
    dense = load_model(model_dir, cpu, torch.float32, "torch")
    assert "dequantized at load (not supported packed): Q5_0 x2, Q5_K x1" in caplog.text
    layers = packed.model.layers
    assert layers[0].self_attn.qkv_proj.packed.type_names() == ["Q4_K", "Q6_K"]
    assert layers[1].self_attn.qkv_proj.packed.type_names() == ["Q4_0", "Q6_K"]
    assert layers[0].mlp.gate_up_proj.packed.type_names() == ["Q5_K"]
    # Its Q5_K gate exists in the packed layout only as a first column: loaded dense
    # from the GGUF, equal to the full conversion.
    assert layers[1].mlp.gate_up_proj.packed is None
    torch.testing.assert_close(
        layers[1].mlp.gate_up_proj.weight,
        dense.model.layers[1].mlp.gate_up_proj.weight,
        rtol=0,
        atol=0,
    )
    assert layers[1].self_attn.o_proj.packed is None  # Q5_0 stays dense
    assert layers[0].self_attn.o_proj.packed.type_names() == ["Q4_1"]
    for layer_p, layer_d in zip(layers, dense.model.layers):
        torch.testing.assert_close(
            layer_p.self_attn.qkv_proj.packed.dequantize(), layer_d.self_attn.qkv_proj.weight
        )
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (5, 12)]
    got = GreedyDriver(packed, max_rows=2, max_context=64).generate(prompts, 8)
    want = GreedyDriver(dense, max_rows=2, max_context=64).generate(prompts, 8)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        assert _max_rel_diff(torch.stack(g.logits), torch.stack(w.logits)) < LOGIT_REL_TOL
