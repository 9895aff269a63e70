"""The GPU goals script (tests/gpu/kernel_goals.py) checked on the CPU: it imports, its
kernel checks (tests/gpu/kernel_checks.py) run under Triton's interpreter and fail on a
wrong kernel, the parts that need no GPU compute what they say, and its dry run takes
every step of the GPU run at tiny sizes, so a broken step fails here, not in a device
session's few minutes."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from engine.layers.triton_ops import paged_attention as kernels
from tests.gpu import kernel_checks, kernel_goals

SCRIPT = Path(kernel_goals.__file__)


def test_script_parses_and_has_a_main() -> None:
    tree = ast.parse(SCRIPT.read_text())
    names = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert {"main", "matmul_floor", "greedy_identity", "mixed_schedules"} <= names
    assert kernel_goals.check_kernels is kernel_checks.check_kernels


@pytest.mark.slow
def test_the_dry_run_takes_every_step_and_prints_every_figure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The outlier case prefills its long prompt over more steps than it times, as on the
    # GPU (a version that let the short requests end first had no step to time there).
    dry = kernel_goals.DRY
    assert -(-dry.outlier // dry.engine["chunked_prefill_size"]) > dry.outlier_steps
    assert kernel_goals.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines if line}
    measured = {line.split()[1] for line in lines if line.startswith("measured: ")}
    for name in kernel_goals.GOALS:
        assert name in rows, name
        float(rows[name][0].replace(",", ""))  # a figure was measured
        assert name in measured, name  # and printed then, not only in the final table
    # fp32 greedy tokens: the Triton kernels (interpreted) and the gather path agree.
    greedy = [line for line in lines if line.startswith("greedy fp32")]
    assert len(greedy) == 5 and all(line.split()[-3] == "same" for line in greedy), greedy


def test_decode_step_times_waits_for_a_long_prompt_and_leaves_no_request(
    tmp_path: Path,
) -> None:
    from tests.gpu.conftest import make_model

    model = make_model(tmp_path / "m", hidden_size=64, intermediate_size=128, num_hidden_layers=1)
    engine = kernel_goals.make_engine(
        model, "cpu", "float32", kernel_goals.DRY, kv_cache_tokens=4096
    )
    # 300 tokens in chunks of 64: five prefill steps, while the short ones decode.
    times = kernel_goals.decode_step_times(engine, [8, 8, 300], 3, "cpu")
    assert len(times) == 3 and all(t > 0 for t in times)
    assert not engine.has_work and engine.stats()["kv_used"] == 0
    engine.close()


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
