"""The native small-M matmul (csrc/gemv_cpu.cpp) against ``F.linear``.

Random inputs for every row count the kernel takes, odd N and K (tails of the 16-wide
vectors and of the row blocks), with and without bias, strided inputs; the whole model
against HF transformers with the kernel on and off (tied and untied LM head, decode
batches of 1 and 2 rows actually going through it); the memory it keeps (dense weights
next to oneDNN's, the tied head sharing the embedding); and the fallback when the kernel
cannot be built (the build forced to fail).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaConfig

from engine.layers import gemv_cpu
from engine.layers.linear import FusedLinear
from engine.loader import load_model
from tests.unit.hf_reference import randomize
from tests.unit.model_configs import TINY
from tests.unit.model_driver import GreedyDriver
from tests.unit.native_build import fail_native_build


@pytest.fixture(scope="module")
def kernel() -> Any:
    module = gemv_cpu.gemv_kernel()
    assert module is not None, gemv_cpu.build_error()
    return module


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """F.linear in float64: independent of either float32 summation order."""
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (7, 15), (37, 53), (960, 576), (1001, 577)])
def test_every_row_count_matches_f_linear(kernel: Any, n: int, k: int, bias: bool) -> None:
    assert kernel.MAX_TOKENS == 8
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    for tokens in range(1, kernel.MAX_TOKENS + 1):
        x = torch.randn(tokens, k, generator=gen)
        got = kernel.gemv(x, w, b)
        assert got.shape == (tokens, n) and got.is_contiguous()
        torch.testing.assert_close(got, _reference(x, w, b), rtol=1e-5, atol=1e-5 * k**0.5)


def test_strided_inputs_are_read_as_they_are(kernel: Any) -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(45, 33, generator=gen)
    wide = torch.randn(6, 50, generator=gen)
    rows = wide[::2, 3:36]  # [3, 33], row stride 100, unit column stride
    columns = torch.randn(33, 4, generator=gen).t()  # [4, 33], column stride 4
    for x in (rows, columns):
        assert not x.is_contiguous()
        torch.testing.assert_close(kernel.gemv(x, w, None), _reference(x, w, None))


def test_empty_batches_and_bad_arguments(kernel: Any) -> None:
    w = torch.randn(10, 16)
    assert kernel.gemv(torch.empty(0, 16), w, None).shape == (0, 10)
    with pytest.raises(RuntimeError, match="at most 8 rows, got 9"):
        kernel.gemv(torch.randn(9, 16), w, None)
    with pytest.raises(RuntimeError, match="has K=15 but weight is"):
        kernel.gemv(torch.randn(2, 15), w, None)
    with pytest.raises(RuntimeError, match="weight must be a contiguous"):
        kernel.gemv(torch.randn(2, 10), w.t(), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        kernel.gemv(torch.randn(2, 16), w, torch.randn(11))
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        with pytest.raises(RuntimeError, match="must be float32"):
            kernel.gemv(torch.randn(2, 16).to(dtype), w.to(dtype), None)


def test_avx512_flags_only_for_the_kernel_that_asks_and_a_cpu_that_has_it() -> None:
    from engine.layers import cpu_kernels

    has_avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    assert ("-mavx512f" in cpu_kernels._cflags(avx512=True)) == has_avx512
    assert "-mavx512f" not in cpu_kernels._cflags(avx512=False)
    assert gemv_cpu._GEMV.avx512


def test_layer_uses_it_up_to_its_threshold_only(kernel: Any) -> None:
    gen = torch.Generator().manual_seed(3)
    layer = FusedLinear(40, [24, 9], bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(33, 40, generator=gen))
        layer.bias.copy_(torch.randn(33, generator=gen))  # type: ignore[union-attr]
    calls: list[int] = []

    def counted(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel.gemv(x, w, b)

    layer.gemv, layer.gemv_max_tokens = counted, 2
    assert layer.pack_for_cpu()
    assert layer.weight.shape == (33, 40)  # the kernel's dense copy stays next to oneDNN's
    for tokens in (1, 2, 3, 16):
        x = torch.randn(tokens, 40, generator=gen)
        expected = _reference(x, layer.weight, layer.bias)
        torch.testing.assert_close(layer.forward(x), expected, rtol=1e-5, atol=1e-4)
    assert calls == [1, 2]


def _tiny_hf(path: Path, tied: bool) -> Any:
    # intermediate_size 136, not a multiple of 16: a masked tail in down_proj.
    config = LlamaConfig(
        **{**TINY, "intermediate_size": 136}, tie_word_embeddings=tied, mlp_bias=True
    )
    hf_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize(hf_model, seed=11)
    hf_model.save_pretrained(path)
    return hf_model


def _counting_gemv(model: torch.nn.Module) -> list[int]:
    """Wrap every switched layer's kernel; returns the list of row counts it is called with."""
    calls: list[int] = []
    for module in model.modules():
        if isinstance(module, FusedLinear) and module.gemv is not None:
            inner = module.gemv

            def counted(x: torch.Tensor, *rest: Any, inner: Callable[..., Any] = inner) -> Any:
                calls.append(x.shape[0])
                return inner(x, *rest)

            module.gemv = counted
    return calls


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("gemv", [True, False], ids=["gemv", "onednn"])
@torch.inference_mode()
def test_whole_model_matches_hf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gemv: bool, tied: bool
) -> None:
    hf_model = _tiny_hf(tmp_path, tied)
    monkeypatch.setenv(gemv_cpu.ENV_SWITCH, "1" if gemv else "0")
    model = load_model(tmp_path, torch.device("cpu"), torch.float32)
    switched = [m for m in model.modules() if isinstance(m, FusedLinear) and m.gemv is not None]
    # qkv, o, gate_up, down per layer, and the LM head (tied: over the embedding itself).
    assert len(switched) == (2 * 4 + 1 if gemv else 0)
    if gemv and tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.data_ptr()
    calls = _counting_gemv(model)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (13, 6)]
    driver = GreedyDriver(model, seed=3)
    for batch in (prompts[:1], prompts):  # decode steps of 1 row, then of 2
        outs = driver.generate(batch, 6, prefill_chunk=4)
        for prompt, out in zip(batch, outs):
            full = hf_model(torch.tensor([prompt + out.tokens[:-1]])).logits[0, len(prompt) - 1 :]
            torch.testing.assert_close(torch.stack(out.logits), full, atol=1e-4, rtol=1e-4)
    if gemv:  # prefill chunks of 4 rows went to oneDNN; decode and small logit batches here
        assert set(calls) == {1, 2} and len(calls) > 5 * 9
    else:
        assert calls == []


def test_non_float32_models_keep_their_matmuls(tmp_path: Path) -> None:
    _tiny_hf(tmp_path, tied=True)
    model = load_model(tmp_path, torch.device("cpu"), torch.bfloat16)
    assert all(m.gemv is None for m in model.modules() if isinstance(m, FusedLinear))


@torch.inference_mode()
def test_failed_build_falls_back_to_onednn_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    hf_model = _tiny_hf(tmp_path, tied=True)
    message = "error: command 'c++' failed: No such file or directory"
    fail_native_build(monkeypatch, gemv_cpu._GEMV, message)
    with caplog.at_level(logging.WARNING, logger=gemv_cpu.__name__):
        model = load_model(tmp_path, torch.device("cpu"), torch.float32)
    assert gemv_cpu.gemv_kernel() is None
    assert gemv_cpu.build_error() == (
        "RuntimeError: error: command 'c++' failed: No such file or directory"
    )
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "native CPU GEMV kernel unavailable" in warning and "No such file" in warning
    assert "C++ compiler" in warning
    linears = [m for m in model.modules() if isinstance(m, FusedLinear)]
    assert linears and all(m.gemv is None for m in linears)
    prompt = list(range(3, 20))
    out = GreedyDriver(model, seed=3).generate([prompt], 4)[0]
    full = hf_model(torch.tensor([prompt + out.tokens[:-1]])).logits[0, len(prompt) - 1 :]
    torch.testing.assert_close(torch.stack(out.logits), full, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_the_packed_second_copy_only_where_memory_allows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    hf_model = _tiny_hf(tmp_path, tied=True)
    roomy = load_model(tmp_path, torch.device("cpu"), torch.float32)
    served = [m for m in roomy.modules() if isinstance(m, FusedLinear) and m.gemv is not None]
    assert served and all(m._packed is not None and m.weight.numel() for m in served)
    extra = gemv_cpu.second_copy_bytes(roomy)
    assert extra == sum(m.weight.numel() * 4 for m in served)
    share = gemv_cpu.SECOND_COPY_MAX_SHARE
    assert gemv_cpu.second_copies_fit(roomy, available=int(extra / share))
    assert not gemv_cpu.second_copies_fit(roomy, available=int(extra / share) - 8)

    monkeypatch.setattr(gemv_cpu, "available_host_memory", lambda: int(extra / share) - 8)
    with caplog.at_level(logging.WARNING, logger=gemv_cpu.__name__):
        model = load_model(tmp_path, torch.device("cpu"), torch.float32)
    assert "float32 weights held once" in caplog.text
    served = [m for m in model.modules() if isinstance(m, FusedLinear) and m.gemv is not None]
    assert served and all(m._packed is None and m.weight.numel() for m in served)
    # Decode through the kernel, prefill chunks of 4 rows through F.linear: HF's logits.
    prompt = list(range(3, 20))
    out = GreedyDriver(model, seed=3).generate([prompt], 4, prefill_chunk=4)[0]
    full = hf_model(torch.tensor([prompt + out.tokens[:-1]])).logits[0, len(prompt) - 1 :]
    torch.testing.assert_close(torch.stack(out.logits), full, atol=1e-4, rtol=1e-4)
