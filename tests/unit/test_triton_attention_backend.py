"""The Triton attention backend (under Triton's interpreter on the CPU): mixed, extend and
decode forwards against float64 attention, tiny models against HF transformers, and which
backend each device gets."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from engine.layers import triton_ops
from engine.layers.attention import (
    TorchAttentionBackend,
    get_attention_backend,
    sdpa_dtype,
)
from engine.layers.triton_attention import TritonAttentionBackend
from engine.loader import load_model
from tests.unit.hf_reference import (
    assert_batched_greedy_matches_hf,
    hf_greedy,
    random_hf_model,
)
from tests.unit.model_configs import FAMILY_CASES, random_prompts
from tests.unit.model_driver import GreedyDriver
from tests.unit.test_attention_mixed import LAYERS, mixed_case, reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(("kv_heads", "group"), [(1, 1), (2, 2), (1, 4)])
@pytest.mark.parametrize(
    ("decode_lens", "extends"),
    [
        ([5], [(0, 7)]),  # one decode beside a whole short prompt
        ([9, 1, 30], [(12, 6), (0, 4)]),  # a later chunk (prefix) and a fresh prompt
        ([17, 3], []),  # decode only
    ],
)
def test_forward_matches_reference(
    kv_heads: int, group: int, decode_lens: list[int], extends: Any
) -> None:
    pool, meta, q, k, v = mixed_case(kv_heads, group, decode_lens, extends, seed=len(extends))
    if not extends:
        meta.is_decode = True
    backend = TritonAttentionBackend()
    for layer in range(LAYERS):
        got = backend.forward(q, k, v, layer, meta, pool)
        torch.testing.assert_close(pool.k_buffers[layer][meta.out_slots], k)
        torch.testing.assert_close(pool.v_buffers[layer][meta.out_slots], v)
        want = reference(pool, layer, meta, q)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Gemma 2 on Triton: a windowed and a global layer, soft-capping, custom scale, GQA."""
    config = FAMILY_CASES["gemma2"]()
    hf_model = random_hf_model(config, seed=5, attn_implementation="eager")
    path = tmp_path_factory.mktemp("gemma2")
    hf_model.save_pretrained(path)
    model = load_model(path, torch.device("cpu"), torch.float32, attention_backend="triton")
    assert model.attn_backend.name == "triton"
    return hf_model, model


def test_tiny_models_match_hf_greedy(tiny: Any) -> None:
    hf_model, model = tiny
    layers = [layer.self_attn.attn_backend for layer in model.model.layers]
    # Windowed layers run the same kernel with their options, not the per-sequence path.
    assert all(isinstance(b, TritonAttentionBackend) for b in layers)
    assert any(b.sliding_window is not None for b in layers)
    prompts = random_prompts((3, 12))
    assert_batched_greedy_matches_hf(hf_model, model, prompts, 6)
    # Chunked prefill over a cached prefix crosses the window.
    ours = GreedyDriver(model, seed=1).generate(prompts[1:], 6, prefill_chunk=5)
    assert ours[0].tokens == hf_greedy(hf_model, prompts[1], 6)


# ---- which backend a device gets --------------------------------------------------------


def test_auto_on_a_gpu_with_triton_picks_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[torch.device] = []

    def works(device: torch.device) -> None:
        seen.append(device)

    monkeypatch.setattr(triton_ops, "unavailable_reason", works)
    backend = get_attention_backend("auto", torch.device("cuda"), torch.bfloat16)
    assert isinstance(backend, TritonAttentionBackend)
    assert seen == [torch.device("cuda")]


def test_auto_without_triton_falls_back_to_gather_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(triton_ops, "unavailable_reason", lambda device: "no driver here")
    with caplog.at_level(logging.WARNING):
        backend = get_attention_backend("auto", torch.device("cuda"), torch.bfloat16)
    assert type(backend) is TorchAttentionBackend
    assert "no driver here" in caplog.text and "gathers" in caplog.text
    with pytest.raises(RuntimeError, match="no driver here"):
        get_attention_backend("triton", torch.device("cuda"), torch.bfloat16)


def test_cpu_keeps_the_native_or_torch_backend() -> None:
    # Even with the interpreter on, auto on the CPU never picks the Triton kernel.
    backend = get_attention_backend("auto", torch.device("cpu"), torch.float32)
    assert backend.name in ("cpu_native", "torch")
    assert get_attention_backend("auto", torch.device("cpu"), torch.bfloat16).name == "torch"


def test_unavailable_reason_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "device type 'cpu'" in (triton_ops.unavailable_reason(torch.device("cpu")) or "")
    # This machine has no GPU driver: triton says so, and the reason carries it.
    assert triton_ops.unavailable_reason(torch.device("cuda")) is not None


@pytest.mark.parametrize(
    ("device_type", "dtype", "expected"),
    [
        ("musa", torch.bfloat16, torch.bfloat16),  # MUSA: no float32 upcast any more
        ("cuda", torch.float16, torch.float16),
        ("cpu", torch.bfloat16, torch.float32),
        ("npu", torch.float16, torch.float32),
        ("musa", torch.float32, torch.float32),
    ],
)
def test_sdpa_dtype(device_type: str, dtype: torch.dtype, expected: torch.dtype) -> None:
    assert sdpa_dtype(device_type, dtype) == expected
