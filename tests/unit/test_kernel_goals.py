"""The GPU goals script (tests/gpu/kernel_goals.py) checked on the CPU: it imports, its
kernel check runs under Triton's interpreter and fails on a wrong kernel, and the parts
that need no GPU compute what they say."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from engine.layers.triton_ops import paged_attention as kernels
from tests.gpu import kernel_goals

SCRIPT = Path(kernel_goals.__file__)


def test_script_parses_and_has_a_main() -> None:
    tree = ast.parse(SCRIPT.read_text())
    names = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert {
        "main",
        "check_kernels",
        "check_moe",
        "matmul_floor",
        "greedy_identity",
        "mixed_schedules",
    } <= names


@pytest.mark.slow
def test_kernel_check_runs_under_the_interpreter_and_catches_a_wrong_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    results = kernel_goals.check_kernels("cpu")
    assert len(results) == 5 and all(error <= tol for _, error, tol in results)
    real = kernels.paged_attention

    def off_by_a_little(*args: Any, **kwargs: Any) -> torch.Tensor:
        return real(*args, **kwargs) + 1e-2

    monkeypatch.setattr(kernels, "paged_attention", off_by_a_little)
    with pytest.raises(AssertionError, match="decode fp32 splits"):
        kernel_goals.check_kernels("cpu")


def test_moe_check_runs_under_the_interpreter_and_catches_a_wrong_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.layers.triton_ops import fused_moe

    results = kernel_goals.check_moe("cpu")
    assert [name for name, *_ in results] == [
        "moe float32 1 tokens",
        "moe bfloat16 1 tokens",
        "moe float32 9 tokens",
        "moe bfloat16 9 tokens",
    ]
    real = fused_moe.fused_experts

    def one_choice_only(x: Any, w13: Any, w2: Any, experts: Any, weights: Any) -> torch.Tensor:
        return real(x, w13, w2, experts[:, :1], weights[:, :1])

    monkeypatch.setattr(fused_moe, "fused_experts", one_choice_only)
    with pytest.raises(AssertionError, match="moe float32 1 tokens"):
        kernel_goals.check_moe("cpu")


def test_matmul_floor_times_every_layers_projections(monkeypatch: pytest.MonkeyPatch) -> None:
    shapes: list[tuple[int, int]] = []

    def fake_timed(fn: Any, device: str, repeats: int = 5) -> float:
        shapes.append(tuple(fn().shape))  # type: ignore[arg-type]
        return 0.001

    monkeypatch.setattr(kernel_goals, "timed", fake_timed)
    config = dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,
    )
    seconds = kernel_goals.matmul_floor(config, 8, "cpu")
    # qkv (4 + 2 * 2 heads of 16), o, gate+up, down; for 8 tokens, times 3 layers.
    assert shapes == [(8, 128), (8, 64), (8, 192), (8, 64)]
    assert seconds == pytest.approx(4 * 0.001 * 3)


def test_the_report_says_whether_launches_took_smaller_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.layers.triton_ops import fitting

    monkeypatch.setattr(fitting, "_chosen", {("paged_attention", "bf16"): 0})
    assert kernel_goals.launch_options_line().endswith("every launch took its first")
    monkeypatch.setattr(fitting, "_chosen", {("paged_attention", "fp32"): 2, ("moe",): 0})
    line = kernel_goals.launch_options_line()
    assert "('paged_attention', 'fp32') option 2" in line and "moe" not in line
