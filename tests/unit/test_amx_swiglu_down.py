"""The MLP of a batch on the AMX tiles in two passes (quant_cpu's ``qmatmul_swiglu_down``):
SwiGLU's result goes from the gate/up tiles straight into the down product's token tiles.
Bit for bit what ``qmatmul_swiglu`` then ``qmatmul`` give, for every pair of weight types
(the down product's tokens rounded to bf16, or split into high and low parts), and the MLP
takes it only where it should."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.layers import fused_cpu, quant_cpu
from engine.layers.linear import FusedLinear, GatedMLP
from engine.layers.quant_cpu import BF16, QuantTensor
from tests.unit.quant_blocks import placed, random_blocks

Q4_1, Q4_K = 3, 12


@pytest.fixture(scope="module")
def module() -> Any:
    kernel = quant_cpu.quant_kernel()
    assert kernel is not None, quant_cpu.build_error()
    if not kernel.AMX:
        pytest.skip("this CPU has no AMX (or the kernel refused its use)")
    return kernel


def apart(module: Any, x: torch.Tensor, gate_up: Any, gq: int, down: Any, dq: int) -> torch.Tensor:
    """SwiGLU in the gate/up pass to float32 memory, then the down product."""
    hidden = torch.empty(x.shape[0], gate_up.shape[0] // 2)
    assert module.qmatmul_swiglu(x, gate_up, gq, hidden)
    out = torch.empty(x.shape[0], down.shape[0])
    module.qmatmul(hidden, down, dq, out)
    return out


@pytest.mark.parametrize(
    ("gq", "dq", "inter"),
    [(BF16, BF16, 64), (Q4_1, Q4_1, 96), (Q4_K, BF16, 256), (BF16, Q4_K, 256), (Q4_1, BF16, 32)],
    ids=["BF16/BF16", "Q4_1/Q4_1", "Q4_K/BF16", "BF16/Q4_K", "Q4_1/BF16"],
)
def test_equals_swiglu_then_down(module: Any, gq: int, dq: int, inter: int) -> None:
    hidden = 256 if gq == Q4_K else 64
    gen = torch.Generator().manual_seed(gq * 100 + dq)
    gate_up = placed(random_blocks(gq, 2 * inter, hidden, seed=1), 0)
    # 40 output rows: a partial last chunk of the down product; the down weight copied
    # (offset 16) for bf16, so its rows are packed rather than read in place.
    down = placed(random_blocks(dq, 40, inter, seed=2), 16 if dq == BF16 else 0)
    for tokens in (5, 33, 261):  # partial token blocks, and several token groups
        x = torch.randn(tokens, hidden, generator=gen)
        out = torch.full((tokens, 40), float("nan"))
        assert module.qmatmul_swiglu_down(x, gate_up, gq, down, dq, out)
        assert torch.equal(out, apart(module, x, gate_up, gq, down, dq)), tokens


def test_not_taken_where_the_swiglu_pass_is_not(module: Any) -> None:
    gate_up = placed(random_blocks(BF16, 128, 64, seed=3), 0)
    down = placed(random_blocks(BF16, 32, 64, seed=4), 0)
    out = torch.full((4, 32), float("nan"))
    assert not module.qmatmul_swiglu_down(torch.randn(4, 64), gate_up, BF16, down, BF16, out)
    assert out.isnan().all()  # nothing written: the caller takes the other path
    before = module.set_amx(False)
    try:
        out = torch.full((40, 32), float("nan"))
        assert not module.qmatmul_swiglu_down(torch.randn(40, 64), gate_up, BF16, down, BF16, out)
        assert out.isnan().all()
    finally:
        module.set_amx(before)


def test_refuses_mismatched_weights_and_outputs(module: Any) -> None:
    x = torch.randn(8, 64)
    gate_up = placed(random_blocks(BF16, 128, 64, seed=5), 0)
    with pytest.raises(RuntimeError, match="weight rows hold"):  # down built for I = 32
        module.qmatmul_swiglu_down(
            x, gate_up, BF16, placed(random_blocks(BF16, 32, 32, seed=6), 0), BF16,
            torch.empty(8, 32),
        )  # fmt: skip
    down = placed(random_blocks(BF16, 32, 64, seed=6), 0)
    with pytest.raises(RuntimeError, match=r"out must be \[M, H\]"):
        module.qmatmul_swiglu_down(x, gate_up, BF16, down, BF16, torch.empty(8, 64))
    odd = placed(random_blocks(BF16, 127, 64, seed=7), 0)
    with pytest.raises(RuntimeError, match="even number of rows"):
        module.qmatmul_swiglu_down(x, odd, BF16, down, BF16, torch.empty(8, 32))


def packed_mlp(gen: torch.Generator) -> GatedMLP:
    mlp = GatedMLP(64, 64)
    for linear, rows, cols in ((mlp.gate_up_proj, 128, 64), (mlp.down_proj, 64, 64)):
        weight = torch.randn(rows, cols, generator=gen).bfloat16()
        linear.use_packed().put(
            0, QuantTensor(BF16, weight.view(torch.uint8).reshape(rows, -1).clone(), cols)
        )
    mlp.act_mul = fused_cpu.fused_kernels().silu_mul
    return mlp


def test_gated_mlp_takes_it_where_both_weights_are_plain_packed_layers(
    module: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(0)
    mlp = packed_mlp(gen)
    packed = mlp.gate_up_proj.packed
    assert packed is not None
    taken: list[bool] = []
    fused = packed.swiglu_down

    def spy(x: torch.Tensor, down: Any) -> torch.Tensor | None:
        out = fused(x, down)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(packed, "swiglu_down", spy)
    for tokens, expected in ((40, True), (3, False)):
        x = torch.randn(tokens, 64, generator=gen)
        got = mlp.forward(x)
        assert taken.pop() is expected
        with monkeypatch.context() as without:
            without.setattr(packed, "swiglu_down", lambda x, down: None)
            assert torch.equal(got, mlp.forward(x)), tokens
    # A down projection that reduces its output (a subclass: row-parallel under TP) is
    # left to its own forward.

    class Reducing(FusedLinear):
        pass

    reducing = Reducing(64, [64])
    reducing.packed = mlp.down_proj.packed
    mlp.down_proj = reducing
    mlp.forward(torch.randn(40, 64, generator=gen))
    assert taken == []
