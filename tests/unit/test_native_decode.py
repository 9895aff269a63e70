"""A packed model's decode steps as one native call (csrc/decode_layers.h) against the
same model's Python layers: the same kernels in the same order, so the logits of every
decode step are the same bits, and the greedy tokens the same.

Checked on the default model (packed Q4_1, decoding one row and three rows together) and
on a tiny Llama built here with q/k/v, o and MLP biases and a mix of packed types; and
which models (and steps) keep the Python layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from engine.layers import quant_cpu
from engine.layers.attention import get_attention_backend
from engine.layers.fused_cpu import use_fused_cpu_kernels
from engine.layers.linear import FusedLinear
from engine.layers.quant_cpu import QuantTensor
from engine.loader import default_gguf_path, load_model, resolve_model_path
from engine.models import native_decode
from engine.models.llama import LlamaForCausalLM
from engine.models.native_decode import use_native_decode, why_not
from tests.unit.model_configs import TINY
from tests.unit.model_driver import GreedyDriver
from tests.unit.quant_blocks import random_blocks


def _both_paths(
    model: Any, prompts: list[list[int]], tokens: int, pool: torch.dtype = torch.float32
) -> None:
    """Greedy generation with the native decode step and without: identical logits
    (``pool``: the KV pool's dtype, --kv-cache-dtype)."""
    assert model.native_decode is not None
    rows = max(4, len(prompts))
    native = GreedyDriver(model, max_rows=rows, max_context=96, dtype=pool).generate(
        prompts, tokens
    )
    saved, model.native_decode = model.native_decode, None
    try:
        python = GreedyDriver(model, max_rows=rows, max_context=96, dtype=pool).generate(
            prompts, tokens
        )
    finally:
        model.native_decode = saved
    for got, want in zip(native, python):
        assert got.tokens == want.tokens
        for step, (a, b) in enumerate(zip(got.logits, want.logits)):
            assert torch.equal(a, b), (step, (a - b).abs().max())


@pytest.fixture(scope="module")
def packed_default() -> Any:
    packed_dir = resolve_model_path("default", packed=True)
    cpu = torch.device("cpu")
    return load_model(packed_dir, cpu, torch.float32, "auto", gguf_path=default_gguf_path())


@pytest.mark.slow
@torch.inference_mode()
def test_default_model_decodes_natively_with_the_python_layers_logits(
    packed_default: Any,
) -> None:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (7, 19, 4)]
    _both_paths(packed_default, prompts, 12)  # three rows together
    _both_paths(packed_default, prompts[1:2], 12)  # one row: the 1-token matmul path


@pytest.mark.slow
@torch.inference_mode()
def test_a_batch_past_the_register_path_decodes_natively_with_the_same_logits(
    packed_default: Any,
) -> None:
    # 6 rows: more than GEMV_MAX_TOKENS, so on a CPU with AMX the matmuls take the tiles
    # and the gate/up product applies SwiGLU in its own pass, in both paths (elsewhere the
    # FMA tiles and a separate SwiGLU, in both paths).
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (5, 11, 3, 8, 2, 6)]
    assert len(prompts) > quant_cpu.quant_kernel().GEMV_MAX_TOKENS
    _both_paths(packed_default, prompts, 8)


@pytest.mark.slow
@torch.inference_mode()
def test_native_decode_over_a_bf16_pool_has_the_python_layers_logits(packed_default: Any) -> None:
    # --kv-cache-dtype bfloat16: the native step stores and reads the bf16 pool through the
    # same kernels as the Python layers' attention backend.
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (9, 3)]
    _both_paths(packed_default, prompts, 10, pool=torch.bfloat16)


def _quantize(weight: torch.Tensor, qtype: int) -> QuantTensor:
    rows, cols = weight.shape
    kind = gguf.GGMLQuantizationType(qtype)
    try:
        blocks = gguf.quants.quantize(weight.numpy().astype(np.float32), kind)
    except NotImplementedError:  # the K-quants: random blocks of the same shape
        blocks = random_blocks(qtype, rows, cols, seed=rows + cols)
    return QuantTensor(qtype, torch.from_numpy(np.ascontiguousarray(blocks)), cols)


def tiny_packed_llama(bias: bool) -> LlamaForCausalLM:
    """A tiny Llama with random weights, every linear layer packed (Q8_0, Q4_1, Q4_K,
    Q6_K: the K-quants need 256 columns), biases where ``bias``."""
    config = LlamaConfig(
        **{**TINY, "hidden_size": 256, "intermediate_size": 512},
        head_dim=64,
        attention_bias=bias,
        mlp_bias=bias,
        tie_word_embeddings=True,
    )
    backend = get_attention_backend("cpu_native", torch.device("cpu"), torch.float32)
    model = LlamaForCausalLM(config, backend)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
        for norm in (m for m in model.modules() if hasattr(m, "eps")):
            norm.weight.add_(1.0)
    types = [8, 3, 12, 14]  # Q8_0, Q4_1, Q4_K, Q6_K in turn
    for i, linear in enumerate(m for m in model.modules() if isinstance(m, FusedLinear)):
        weight = linear.weight.detach().clone()
        packed = linear.use_packed()
        packed.put(0, _quantize(weight, types[i % len(types)]))
        packed.finish()
    assert use_fused_cpu_kernels(model) > 0
    return model.eval()


@pytest.mark.parametrize("bias", [True, False])
@torch.inference_mode()
def test_a_packed_llama_with_biases_decodes_natively_with_the_same_logits(bias: bool) -> None:
    model = tiny_packed_llama(bias)
    assert (model.model.layers[0].self_attn.qkv_proj.bias is not None) == bias
    assert use_native_decode(model)
    assert model.native_decode.layers.num_layers == 2
    prompts = [[5, 9, 200, 31], [17], [250, 1, 2, 3, 4, 5, 6, 7, 8]]
    _both_paths(model, prompts, 10)


def test_the_native_call_is_what_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Not a silent fallback: a decode step goes through native_decode, a prefill does not.
    model = tiny_packed_llama(False)
    assert use_native_decode(model)
    calls: list[int] = []
    real = model.native_decode

    def counting(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(hidden.shape[0])
        return real(hidden, *args)

    model.native_decode = counting
    GreedyDriver(model, max_rows=2, max_context=32).generate([[3, 4, 5], [6]], 4)
    assert calls == [2, 2, 2]  # the prompts' prefill is one step, then 3 decode steps


class _PendingLoad:
    def wait_layer(self, layer_id: int) -> None:
        pass


def test_a_step_waiting_for_a_host_tier_load_keeps_the_python_layers() -> None:
    model = tiny_packed_llama(False)
    assert use_native_decode(model)
    driver = GreedyDriver(model, max_rows=2, max_context=32)
    meta = driver._meta(True, [1], [0], [0], [1])
    meta.kv_loads.append(_PendingLoad())

    def refuse(*args: Any) -> torch.Tensor:
        raise AssertionError("a step with host-tier loads must wait layer by layer")

    model.native_decode = refuse
    with torch.inference_mode():
        hidden = model(torch.tensor([3]), torch.tensor([0]), meta, driver.pool)
    assert hidden.shape == (1, 256)


def test_models_that_do_not_qualify_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_packed_llama(False)
    assert why_not(model) is None
    model.model.layers[1].mlp.down_proj.packed = None
    assert "not packed" in (why_not(model) or "")
    model = tiny_packed_llama(False)
    model.model.layers[0].self_attn.attn_backend = get_attention_backend("torch")
    assert "attention backend torch" in (why_not(model) or "")
    model = tiny_packed_llama(False)
    model.model.norm.fused_add_norm = None
    assert "RMSNorm" in (why_not(model) or "")
    monkeypatch.setenv(native_decode.ENV_SWITCH, "0")
    assert not use_native_decode(tiny_packed_llama(False))


@pytest.mark.slow
def test_the_dense_float32_default_model_keeps_the_python_layers(default_model_dir: Path) -> None:
    dense = load_model(default_model_dir, torch.device("cpu"), torch.float32, "auto")
    assert dense.native_decode is None
    assert "not packed" in (why_not(dense) or "")
