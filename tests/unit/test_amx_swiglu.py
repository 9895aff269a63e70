"""SwiGLU in the packed gate/up product's own pass on the AMX tiles (quant_amx.h's
``swiglu`` chunks): the same floats as multiplying, then fused_ops.h's ``silu_mul``, and
the MLP takes it wherever the kernel does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.layers import fused_cpu, quant_cpu
from engine.layers.linear import GatedMLP
from engine.layers.quant_cpu import BF16, QuantTensor
from tests.unit.quant_blocks import placed, random_blocks


@pytest.fixture(scope="module")
def module() -> Any:
    kernel = quant_cpu.quant_kernel()
    assert kernel is not None, quant_cpu.build_error()
    if not kernel.AMX:
        pytest.skip("this CPU has no AMX (or the kernel refused its use)")
    return kernel


@pytest.mark.parametrize(
    ("qtype", "cols", "offset"),
    [(BF16, 64, 0), (BF16, 64, 16), (3, 64, 0), (12, 256, 0)],
    ids=["BF16 in place", "BF16 copied", "Q4_1", "Q4_K"],
)
def test_swiglu_pass_equals_multiplying_then_silu_mul(
    module: Any, qtype: int, cols: int, offset: int
) -> None:
    silu_mul = fused_cpu.fused_kernels().silu_mul
    gen = torch.Generator().manual_seed(qtype + offset)
    # 48: whole chunks of 16 columns; 37: a partial last chunk; 4,112 x 261 tokens: an
    # output of 4.3 MB, streamed past the caches, and a partial block of tokens.
    for half, tokens in ((48, 5), (37, 33), (4112, 261)):
        weight = placed(random_blocks(qtype, 2 * half, cols, seed=half), offset)
        x = torch.randn(tokens, cols, generator=gen)
        product = torch.empty(tokens, 2 * half)
        module.qmatmul(x, weight, qtype, product)
        out = torch.full((tokens, half), float("nan"))
        assert module.qmatmul_swiglu(x, weight, qtype, out)
        assert torch.equal(out, silu_mul(product)), (half, tokens)
    # 4 tokens (the register path) or AMX turned off: nothing written, the caller
    # multiplies and applies SwiGLU apart.
    out = torch.full((4, half), float("nan"))
    assert not module.qmatmul_swiglu(x[:4], weight, qtype, out)
    assert out.isnan().all()
    before = module.set_amx(False)
    try:
        assert not module.qmatmul_swiglu(x, weight, qtype, torch.empty(tokens, half))
    finally:
        module.set_amx(before)


def test_swiglu_refuses_an_odd_weight_and_a_wrong_output(module: Any) -> None:
    weight = torch.from_numpy(random_blocks(BF16, 7, 64, seed=1))
    with pytest.raises(RuntimeError, match="even number of rows"):
        module.qmatmul_swiglu(torch.randn(8, 64), weight, BF16, torch.empty(8, 3))
    weight = torch.from_numpy(random_blocks(BF16, 8, 64, seed=1))
    with pytest.raises(RuntimeError, match=r"out must be \[M, I\]"):
        module.qmatmul_swiglu(torch.randn(8, 64), weight, BF16, torch.empty(8, 8))


def test_gated_mlp_takes_swiglu_in_the_packed_products_pass(
    module: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(0)
    mlp = GatedMLP(64, 48)
    gate_up = torch.randn(96, 64, generator=gen).bfloat16()
    packed = mlp.gate_up_proj.use_packed()
    packed.put(0, QuantTensor(BF16, gate_up.view(torch.uint8).reshape(96, -1).clone(), 64))
    mlp.down_proj.weight.data = torch.randn(64, 48, generator=gen)
    mlp.act_mul = fused_cpu.fused_kernels().silu_mul
    taken: list[bool] = []
    swiglu = packed.swiglu

    def spy(x: torch.Tensor) -> torch.Tensor | None:
        out = swiglu(x)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(packed, "swiglu", spy)
    for tokens, fused in ((40, True), (3, False)):
        x = torch.randn(tokens, 64, generator=gen)
        got = mlp.forward(x)
        assert taken.pop() is fused
        with monkeypatch.context() as apart:
            apart.setattr(packed, "swiglu", lambda x: None)
            assert torch.equal(got, mlp.forward(x)), tokens
    # Without the fused SwiGLU kernel (another activation, or kernels off) it is not asked.
    mlp.act_mul = None
    mlp.forward(torch.randn(40, 64, generator=gen))
    assert taken == []
