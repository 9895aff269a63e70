"""The fused CPU kernels (RMSNorm + residual add, RoPE, SwiGLU) against the PyTorch reference.

Random inputs over several shapes; strided inputs as the model passes them; the whole
model against HF transformers with the kernels on and off; and the fallback when the
kernels cannot be built (the build forced to fail).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaConfig

from engine import sampler as sampler_module
from engine.layers import fused_cpu
from engine.layers.linear import GatedMLP
from engine.layers.rmsnorm import RMSNorm
from engine.layers.rotary import RopeParams, RotaryEmbedding, apply_rotary
from engine.loader import load_model
from engine.sampler import Sampler
from tests.unit.hf_reference import randomize
from tests.unit.model_configs import TINY
from tests.unit.model_driver import GreedyDriver
from tests.unit.native_build import fail_native_build


@pytest.fixture(scope="module")
def kernels() -> Any:
    module = fused_cpu.fused_kernels()
    assert module is not None, fused_cpu.build_error()
    return module


def _fused_layers(model: torch.nn.Module) -> int:
    return sum(
        1
        for m in model.modules()
        if getattr(m, "fused_add_norm", None) is not None
        or getattr(m, "act_mul", None) is not None
        or getattr(m, "rotary_fn", None) not in (None, apply_rotary)
    )


@pytest.mark.parametrize(("tokens", "hidden"), [(1, 64), (7, 576), (300, 1000), (33, 17)])
def test_add_rms_norm_matches_pytorch(kernels: Any, tokens: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(tokens * hidden)
    norm = RMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(hidden, generator=gen))
    x = 3 * torch.randn(tokens, hidden, generator=gen)
    residual = torch.randn(tokens, hidden, generator=gen)
    expected_normed, expected_sum = norm.add_forward(x, residual)  # the PyTorch path
    normed, summed = kernels.add_rms_norm(x, residual, norm.weight, norm.eps)
    torch.testing.assert_close(summed, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(normed, expected_normed, rtol=1e-5, atol=1e-5)
    # Through the layer once switched: the same numbers.
    norm.fused_add_norm = kernels.add_rms_norm
    torch.testing.assert_close(norm.add_forward(x, residual)[0], normed, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("tokens", "q_heads", "kv_heads", "head_dim"), [(1, 9, 3, 64), (5, 4, 2, 32), (130, 8, 8, 128)]
)
def test_rotary_matches_pytorch_on_the_strided_qk_view(
    kernels: Any, tokens: int, q_heads: int, kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(tokens + head_dim)
    rotary = RotaryEmbedding(head_dim, RopeParams("default", 10000.0, {}))
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    cos, sin = rotary.cos_sin(positions, torch.float32)  # [T, 1, head_dim]
    # [T, q + 2 kv, D]; the model rotates the q/k heads of it in place, a strided view.
    qkv = torch.randn(tokens, q_heads + 2 * kv_heads, head_dim, generator=gen)
    qk = qkv[:, : q_heads + kv_heads]
    assert not qk.is_contiguous() or tokens == 1
    expected = apply_rotary(qk, cos, sin)
    got = kernels.rotary(qk, cos, sin)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


# Sizes around the 16-float vector and the 512-column work block, and the model's 1536.
@pytest.mark.parametrize(
    ("tokens", "intermediate"), [(1, 1), (1, 1536), (3, 17), (32, 1536), (7, 1000), (65, 513)]
)
def test_silu_mul_matches_pytorch(kernels: Any, tokens: int, intermediate: int) -> None:
    gen = torch.Generator().manual_seed(tokens * 7919 + intermediate)
    # Wide range (exp saturates past +-88) plus the model's strided view: gate_up is a row
    # slice of a wider buffer here, as a projection output can be.
    wide = 30 * torch.randn(tokens, 2 * intermediate + 5, generator=gen)
    wide[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    gate_up = wide[:, : 2 * intermediate]
    assert not gate_up.is_contiguous() or tokens == 1
    expected = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    got = kernels.silu_mul(gate_up)
    assert got.shape == (tokens, intermediate) and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)


def test_gated_mlp_with_the_fused_swiglu_matches_pytorch(kernels: Any) -> None:
    gen = torch.Generator().manual_seed(11)
    mlp = GatedMLP(48, 80)
    with torch.no_grad():
        for linear in (mlp.gate_up_proj, mlp.down_proj):
            linear.weight.copy_(0.2 * torch.randn(linear.weight.shape, generator=gen))
    x = torch.randn(9, 48, generator=gen)
    expected = mlp.forward(x)  # the PyTorch path
    mlp.act_mul = kernels.silu_mul
    torch.testing.assert_close(mlp.forward(x), expected, rtol=1e-5, atol=1e-6)


def test_only_silu_mlps_get_the_fused_swiglu(kernels: Any) -> None:
    model = torch.nn.ModuleList(
        [GatedMLP(16, 32), GatedMLP(16, 32, activation="gelu_pytorch_tanh")]
    )
    assert fused_cpu.use_fused_cpu_kernels(model) == 1
    assert model[0].act_mul is kernels.silu_mul
    assert model[1].act_mul is None  # GeGLU keeps PyTorch


@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (1, 49152), (3, 17), (32, 49152), (5, 1000)])
def test_argmax_rows_matches_torch(kernels: Any, rows: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(rows * vocab)
    wide = torch.randn(rows, vocab + 3, generator=gen)
    logits = wide[:, :vocab]  # row-strided, as the sampler's [:, :vocab_size] view
    got = kernels.argmax_rows(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.argmax(dim=-1))


def test_argmax_rows_ties_infinities_and_nans_as_torch(kernels: Any) -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(2))
    logits[0, [7, 40, 99]] = 50.0  # ties: the first one wins
    logits[1] = float("-inf")  # a fully masked row
    logits[2, 60] = float("inf")
    logits[3, [33, 80]] = float("nan")  # torch: the first NaN
    logits[4, 97] = 9.0  # the maximum in the scalar tail after the last full vector
    logits[5, 0] = float("nan")
    assert torch.equal(kernels.argmax_rows(logits), logits.argmax(dim=-1))
    assert kernels.argmax_rows(logits).tolist()[:4] == [7, 0, 60, 33]


def test_argmax_switch_off_keeps_torch(monkeypatch: pytest.MonkeyPatch, kernels: Any) -> None:
    assert fused_cpu.cpu_argmax() is kernels.argmax_rows
    monkeypatch.setenv(fused_cpu.ENV_SWITCH, "0")
    assert fused_cpu.cpu_argmax() is None


def test_kernels_refuse_other_dtypes_with_a_clear_error(kernels: Any) -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        x = torch.randn(2, 8).to(dtype)
        with pytest.raises(RuntimeError, match="must be float32"):
            kernels.add_rms_norm(x, x, torch.ones(8, dtype=dtype), 1e-6)
        with pytest.raises(RuntimeError, match="must be float32"):
            kernels.rotary(x.view(2, 1, 8), x, x)
        with pytest.raises(RuntimeError, match="must be float32"):
            kernels.silu_mul(x)
        with pytest.raises(RuntimeError, match="must be float32"):
            kernels.argmax_rows(x)
    with pytest.raises(RuntimeError, match="even number of columns"):
        kernels.silu_mul(torch.randn(2, 7))


def _tiny_hf(path: Path) -> Any:
    config = LlamaConfig(**TINY, tie_word_embeddings=False)
    hf_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize(hf_model, seed=5)
    hf_model.save_pretrained(path)
    return hf_model


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "pytorch"])
@torch.inference_mode()
def test_whole_model_matches_hf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fused: bool
) -> None:
    hf_model = _tiny_hf(tmp_path)
    monkeypatch.setenv(fused_cpu.ENV_SWITCH, "1" if fused else "0")
    model = load_model(tmp_path, torch.device("cpu"), torch.float32)
    # Every RMSNorm (2 per layer + final), attention and MLP (1 per layer each).
    assert _fused_layers(model) == (9 if fused else 0)
    prompt = torch.randint(0, 256, (19,), generator=torch.Generator().manual_seed(1)).tolist()
    driver = GreedyDriver(model, seed=3)
    expected = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(driver.prefill_logits(prompt), expected, atol=1e-4, rtol=1e-4)
    gen = driver.generate([prompt], 8, prefill_chunk=5)[0]  # chunked prefill, then decode
    full = hf_model(torch.tensor([prompt + gen.tokens[:-1]])).logits[0, len(prompt) - 1 :]
    torch.testing.assert_close(torch.stack(gen.logits), full, atol=1e-4, rtol=1e-4)


def test_non_float32_models_keep_pytorch(tmp_path: Path) -> None:
    _tiny_hf(tmp_path)
    model = load_model(tmp_path, torch.device("cpu"), torch.bfloat16)
    assert _fused_layers(model) == 0


@torch.inference_mode()
def test_failed_build_falls_back_to_pytorch_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    hf_model = _tiny_hf(tmp_path)
    message = "error: command 'c++' failed: No such file or directory"
    fail_native_build(monkeypatch, fused_cpu._FUSED, message)
    with caplog.at_level(logging.WARNING, logger=fused_cpu.__name__):
        model = load_model(tmp_path, torch.device("cpu"), torch.float32)
    assert fused_cpu.fused_kernels() is None
    assert fused_cpu.cpu_argmax() is None
    assert Sampler(256, torch.device("cpu")).argmax is sampler_module._torch_argmax
    assert fused_cpu.build_error() == (
        "RuntimeError: error: command 'c++' failed: No such file or directory"
    )
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "fused CPU kernels unavailable" in warning and "No such file" in warning
    assert "C++ compiler" in warning
    assert _fused_layers(model) == 0
    prompt = list(range(3, 20))
    expected = hf_model(torch.tensor([prompt])).logits[0]
    got = GreedyDriver(model, seed=3).prefill_logits(prompt)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
