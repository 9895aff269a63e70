"""The fused Triton element-wise kernels under Triton's interpreter against the PyTorch
layers they replace, and where the loader switches them on."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig

pytest.importorskip("triton")

from engine.layers import triton_ops
from engine.layers.rmsnorm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary, read_rope_params
from engine.layers.triton_ops import fused
from engine.models.llama import LlamaForCausalLM
from tests.unit.fake_backends import UnbuildableKernel
from tests.unit.model_configs import TINY

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [48, 64])
def test_add_rms_norm_matches_the_module(dtype: torch.dtype, hidden: int) -> None:
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden).to(dtype)
    x = torch.randn(5, hidden).to(dtype)
    residual = torch.randn(5, hidden).to(dtype)
    expected_norm, expected_sum = norm.add_forward(x, residual)
    got_norm, got_sum = fused.add_rms_norm(x, residual, norm.weight, norm.eps)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got_sum, expected_sum, atol=tol, rtol=tol)
    torch.testing.assert_close(got_norm, expected_norm, atol=4 * tol, rtol=4 * tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_the_mlp(dtype: torch.dtype) -> None:
    gate_up = torch.randn(4, 2 * 40).to(dtype)
    expected = torch.nn.functional.silu(gate_up[:, :40]) * gate_up[:, 40:]
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(fused.silu_mul(gate_up), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_matches_apply_rotary_on_a_strided_view(dtype: torch.dtype) -> None:
    head_dim = 16
    rope = RotaryEmbedding(head_dim, read_rope_params(LlamaConfig(rope_theta=500.0)))
    positions = torch.tensor([0, 3, 7, 100, 4095])
    cos, sin = rope.cos_sin(positions, dtype)
    # q and k heads as the attention layer passes them: a view of the fused qkv rows.
    qkv = torch.randn(5, 6 + 2, head_dim).to(dtype)
    qk = qkv[:, :6]
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        fused.rotary(qk, cos, sin), apply_rotary(qk, cos, sin), atol=tol, rtol=tol
    )


def test_empty_inputs() -> None:
    assert fused.silu_mul(torch.zeros(0, 8)).shape == (0, 4)
    normed, summed = fused.add_rms_norm(torch.zeros(0, 8), torch.zeros(0, 8), torch.ones(8), 1e-6)
    assert normed.shape == summed.shape == (0, 8)


def test_model_with_fused_ops_gives_the_same_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    for p in model.parameters():
        p.data.normal_(std=0.2)
    x = torch.randn(3, model.config.hidden_size)
    mlp = model.model.layers[0].mlp
    norm = model.model.layers[0].post_attention_layernorm
    expected_mlp, expected_norm = mlp(x), norm.add_forward(x, x)[0]
    # The CPU never switches (it has its own kernels); a GPU with Triton does.
    assert triton_ops.use_fused_ops(model, torch.device("cpu")) == 0
    monkeypatch.setattr(triton_ops, "unavailable_reason", lambda device: None)
    monkeypatch.setenv(triton_ops.FUSED_ENV_SWITCH, "0")
    assert triton_ops.use_fused_ops(model, torch.device("cuda")) == 0  # turned off
    monkeypatch.delenv(triton_ops.FUSED_ENV_SWITCH)
    layers = len(model.model.layers)
    # Two norms and one MLP and one attention per layer, plus the final norm.
    assert triton_ops.use_fused_ops(model, torch.device("cuda")) == 4 * layers + 1
    assert mlp.act_mul is fused.silu_mul and norm.fused_add_norm is fused.add_rms_norm
    assert model.model.layers[0].self_attn.rotary_fn is fused.rotary
    torch.testing.assert_close(mlp(x), expected_mlp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(norm.add_forward(x, x)[0], expected_norm, atol=1e-5, rtol=1e-5)


def test_a_fused_kernel_the_device_cannot_run_leaves_every_op_on_pytorch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    monkeypatch.setattr(triton_ops, "unavailable_reason", lambda device: None)
    broken = UnbuildableKernel()
    monkeypatch.setattr(fused, "_silu_mul_kernel", broken)
    with caplog.at_level(logging.WARNING):
        assert triton_ops.use_fused_ops(model, torch.device("cuda")) == 0
    assert "silu_mul failed here (RuntimeError: PassManager::run failed)" in caplog.text
    assert broken.launches == 1  # tried once, not once per layer
    layer = model.model.layers[0]
    assert layer.mlp.act_mul is None and layer.post_attention_layernorm.fused_add_norm is None
    assert layer.self_attn.rotary_fn is apply_rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_rows_of_strided_views_to_their_slots(dtype: torch.dtype) -> None:
    qkv = torch.randn(4, 3 + 2 * 2, 8).to(dtype)  # [T, q + k + v heads, D]
    k, v = qkv[:, 3:5], qkv[:, 5:]
    k_cache, v_cache = torch.zeros(20, 2, 8, dtype=dtype), torch.zeros(20, 2, 8, dtype=dtype)
    slots = torch.tensor([7, 2, 19, 11])
    fused.store_kv(k, v, slots, k_cache, v_cache)
    assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def test_rotary_store_rotates_q_and_stores_rotated_k_and_v() -> None:
    head_dim, q_heads, kv_heads = 16, 4, 2
    rope = RotaryEmbedding(head_dim, read_rope_params(LlamaConfig()))
    cos, sin = rope.cos_sin(torch.tensor([0, 5, 9]), torch.float32)
    qkv = torch.randn(3, q_heads + 2 * kv_heads, head_dim)
    qk, v = qkv[:, : q_heads + kv_heads], qkv[:, q_heads + kv_heads :]
    k_cache, v_cache = torch.zeros(12, kv_heads, head_dim), torch.zeros(12, kv_heads, head_dim)
    slots = torch.tensor([4, 9, 1])
    q = fused.rotary_store(qk, v, cos, sin, q_heads, slots, k_cache, v_cache)
    rotated = apply_rotary(qk, cos, sin)
    torch.testing.assert_close(q, rotated[:, :q_heads])
    torch.testing.assert_close(k_cache[slots], rotated[:, q_heads:])
    assert torch.equal(v_cache[slots], v)
    untouched = torch.ones(12, dtype=torch.bool)  # nothing else written
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def test_llama_on_the_gpu_stack_matches_the_torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton attention + every fused op (RoPE with the K/V store included) against the
    PyTorch backend and layers: same greedy tokens, close logits, prefill and decode."""
    from engine.layers.attention import TorchAttentionBackend
    from engine.layers.triton_attention import TritonAttentionBackend
    from tests.unit.model_driver import GreedyDriver

    torch.manual_seed(3)
    config = LlamaConfig(**TINY)
    reference = LlamaForCausalLM(config, TorchAttentionBackend())
    for p in reference.parameters():
        p.data.normal_(std=0.2)
    gpu_stack = LlamaForCausalLM(config, TritonAttentionBackend())
    gpu_stack.load_state_dict(reference.state_dict())
    monkeypatch.setattr(triton_ops, "unavailable_reason", lambda device: None)
    triton_ops.use_fused_ops(gpu_stack, torch.device("cuda"))
    attention = [layer.self_attn for layer in gpu_stack.model.layers]
    assert all(a.fused_rope_store and a.rotary_fn is apply_rotary for a in attention)
    prompts = [[5, 9, 2, 7, 11], [3, 1, 4, 1, 5, 9, 2, 6, 5]]
    want = GreedyDriver(reference).generate(prompts, 5)
    got = GreedyDriver(gpu_stack).generate(prompts, 5)
    for ours, theirs in zip(got, want):
        assert ours.tokens == theirs.tokens
        torch.testing.assert_close(
            torch.stack(ours.logits), torch.stack(theirs.logits), atol=1e-4, rtol=1e-4
        )
