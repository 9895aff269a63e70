"""The bytes-per-token count bench.offline and bench.weights share, on a tiny Llama in float32 and bf16 weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.offline import step_weight_tensors, weight_bytes_per_token
from engine.layers import gemv_cpu
from engine.layers.linear import FusedLinear
from engine.loader import load_model


def test_bf16_weights_halve_the_bytes_a_token_reads(tiny_llama_dir: Path) -> None:
    cpu = torch.device("cpu")
    dense = load_model(tiny_llama_dir, cpu, torch.float32, "torch")
    bf16 = load_model(tiny_llama_dir, cpu, torch.float32, "torch", bf16_weights=True)
    linears = [m for m in dense.modules() if isinstance(m, FusedLinear)]
    weights = sum(m.in_features * m.out_features for m in linears)
    norms = sum(p.numel() * 4 for name, p in dense.named_parameters() if "norm" in name)
    # Untied or tied, the LM head is one of the linear layers once use_cpu_gemv has run.
    assert weight_bytes_per_token(dense) == 4 * weights + norms
    assert weight_bytes_per_token(bf16) == 2 * weights + norms
    x = torch.randn(3, dense.config.hidden_size)
    got, want = bf16.compute_logits(x), dense.compute_logits(x)
    assert float((got - want).abs().max() / want.abs().max()) < 0.02  # bf16 rounding only


@pytest.mark.parametrize(
    "gemv, bf16",
    [("1", False), ("0", False), ("1", True)],
    ids=["float32", "float32-onednn-only", "bf16"],
)
def test_the_read_ceiling_reads_every_weight_a_token_reads(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, gemv: str, bf16: bool
) -> None:
    from bench.weights import read_alone

    # GEMV off: float32 weights are held in oneDNN's opaque layout only.
    monkeypatch.setenv(gemv_cpu.ENV_SWITCH, gemv)
    model = load_model(
        tiny_llama_dir, torch.device("cpu"), torch.float32, "torch", bf16_weights=bf16
    )
    linears = [m for m in model.modules() if isinstance(m, FusedLinear)]
    weights = sum(m.in_features * m.out_features for m in linears)
    norms = sum(p.numel() * 4 for name, p in model.named_parameters() if "norm" in name)
    tensors = step_weight_tensors(model)
    assert (
        sum(t.numel() * t.element_size() for t in tensors) == (2 if bf16 else 4) * weights + norms
    )
    assert any(t.is_meta for t in tensors) == (gemv == "0")  # stand-ins, no memory
    real = [t for t in tensors if not t.is_meta]
    assert len({t.data_ptr() for t in real}) == len(real)  # each once
    assert read_alone(tensors, rounds=2) > 0


def test_the_bench_breaks_each_formats_step_down(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import weights

    argv = ["--model", str(tiny_llama_dir), "--formats", "float32", "bf16"]
    weights.main([*argv, "--batch-size", "2", "--output-len", "3", "--single-tokens", "6"])
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("format    floor"))
    table = [line.split() for line in lines[start + 1 : start + 3]]
    rows = {r[0]: [float(v) for v in r[1:]] for r in table}
    assert set(rows) == {"float32", "bf16"}
    for name, (floor, read, step, forward, linears, lm_head, sampling, rest) in rows.items():
        assert floor > 0 and read > 0 and step > 0, name
        assert min(forward, linears, lm_head, sampling) > 0, name
        # each part runs inside every step, so its median is under the step's
        assert max(forward, lm_head, sampling) < step, name
        # five printed values, each rounded to 0.01: up to 0.025 apart (0.02 failed once,
        # 0.28 against 0.26 in float arithmetic)
        assert rest == pytest.approx(step - forward - lm_head - sampling, abs=0.03), name
