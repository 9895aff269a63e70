"""bench.offline's floors: the weight bytes one decode step reads, counted independently
from the HF model's parameters, and the goals the bench prints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from bench import offline
from engine.loader import load_model
from tests.conftest import make_tiny_model


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_weight_bytes_per_token_counts_every_weight_a_decode_step_reads(
    tmp_path: Path, default_model_dir: Path, tied: bool
) -> None:
    path = make_tiny_model(tmp_path, default_model_dir, tie_word_embeddings=tied)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # HF's parameters (a tied table once); a step reads the LM head but not the whole table.
    hf_bytes = sum(p.numel() * p.element_size() for p in hf_model.parameters())
    embed = hf_model.model.embed_tokens.weight
    embed_bytes = embed.numel() * embed.element_size()
    expected = hf_bytes if tied else hf_bytes - embed_bytes
    for pack in ("1", "0"):  # oneDNN-packed linear layers and plain ones
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("HISERVE_CPU_ONEDNN", pack)
            model = load_model(path, torch.device("cpu"), torch.float32)
        assert offline.weight_bytes_per_token(model) == expected


def test_bandwidths_are_plausible_rates() -> None:
    from bench.micro.bandwidth import copy_bandwidth, read_bandwidth

    for rate in (copy_bandwidth(megabytes=8, repeats=3), read_bandwidth(megabytes=8, repeats=3)):
        assert 1e8 < rate.best < 1e13  # bytes/s: between 100 MB/s and 10 TB/s
        assert rate.median <= rate.best


def test_bench_prints_both_floors_and_the_goals(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    offline.main(
        [
            "--model",
            str(tiny_llama_dir),
            "--num-requests",
            "3",
            "--output-len",
            "2",
            "4",
            "--single-tokens",
            "4",
            "--skip-hf",
            "--kv-cache-dtype",
            "bfloat16",
        ]
    )
    out = capsys.readouterr().out
    assert "greedy, fp32, bfloat16 KV," in out  # the pool the engine was built with
    assert "matmul floor of that run" in out
    assert "bandwidth floor of one stream" in out
    assert "read-only floor of one stream" in out and "single stream at" in out
    assert "% of the matmul floor (goal >= 80%)" in out
    assert "% of the bandwidth floor (goal >= 85%)" in out


def test_fused_kernel_bench_runs_on_a_model(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.micro import fused_kernels

    fused_kernels.main(["--model", str(tiny_llama_dir), "--tokens", "1", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "2 layers, heads 4/2x16" in lines[0]
    assert lines[1].strip().startswith("1 tokens: add+rms_norm")
    assert lines[2].strip().startswith("3 tokens:") and "per forward" in lines[2]


def test_prefill_attention_bench_runs_on_a_model(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.micro import prefill_attention

    prefill_attention.main(
        ["--model", str(tiny_llama_dir), "--batches", "3x20", "2x9+30", "--rounds", "2"]
    )
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and "heads 4, kv heads 2, head_dim 16" in lines[0]
    for line, batch in zip(lines[2:], ["3x20", "2x9+30"]):
        fields = line.split()
        # The two paths agree, and each took a measurable time.
        assert fields[0] == batch and float(fields[-1]) < 1e-5
        assert float(fields[1]) > 0 and float(fields[2]) > 0


def test_gemv_bench_runs_on_a_model(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.micro import gemv

    argv = ["--tokens", "1", "3", "--rounds", "1", "--working-set-mib", "1"]
    gemv.main(["--model", str(tiny_llama_dir), *argv])
    lines = capsys.readouterr().out.splitlines()
    assert "read bandwidth" in lines[0]
    # Five shapes per token count, then the sum over one forward.
    assert len(lines) == 1 + 2 * 6
    assert lines[1].startswith("M=1 qkv") and "gemv" in lines[1] and "onednn" in lines[1]
    assert lines[6].startswith("M=1 one forward: gemv")
    assert lines[12].startswith("M=3 one forward")


def test_packed_gemv_bench_runs_every_type_and_shape(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.micro import packed_gemv

    argv = ["--types", "Q4_1", "Q4_K", "--shapes", "64x256", "32x512", "--tokens", "2"]
    packed_gemv.main([*argv, "--working-set-mb", "1", "--rounds", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert "2 token(s)" in lines[0] and "read-only bandwidth" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [
        ("Q4_1", "64x256"),
        ("Q4_1", "32x512"),
        ("Q4_K", "64x256"),
        ("Q4_K", "32x512"),
    ]
    assert all(float(r[2]) > 0 for r in rows)


def test_packed_matmul_bench_times_every_type_and_shape(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bench.micro import packed_matmul

    argv = ["--types", "BF16", "Q8_0", "--shapes", "64x256", "32x512", "--tokens", "40"]
    packed_matmul.main([*argv, "--rounds", "1", "--swiglu", "128x64"])
    lines = capsys.readouterr().out.splitlines()
    assert "40 tokens" in lines[0]
    swiglu = [line for line in lines if line.split()[1] == "SwiGLU"]
    assert len(swiglu) == 2 and all("128x64: apart" in line for line in swiglu)
    mlp = [line for line in lines if line.split()[1] == "MLP"]
    assert len(mlp) == 2 and all("128x64: SwiGLU then down" in line for line in mlp)
    rows = [line.split() for line in lines[2:] if line.split()[1] not in ("SwiGLU", "MLP")]
    assert [(r[0], r[1]) for r in rows] == [
        ("BF16", "64x256"),
        ("BF16", "32x512"),
        ("BF16", "all"),
        ("Q8_0", "64x256"),
        ("Q8_0", "32x512"),
        ("Q8_0", "all"),
    ]
    shapes = [r for r in rows if r[1] != "all"]
    assert all(float(r[2]) >= 0 and float(r[4]) >= 0 for r in shapes)
    with pytest.raises(SystemExit):  # 1-4 tokens take the register path: not this bench
        packed_matmul.main(["--tokens", "4"])


def test_packed_gemv_bench_weights_are_finite() -> None:
    # Random bytes everywhere but the fp16 fields: no NaN or inf reaches the products.
    from bench.micro import packed_gemv
    from engine.layers.quant_cpu import PACKED_TYPES, quant_kernel

    kernel = quant_kernel()
    assert kernel is not None
    gen = torch.Generator().manual_seed(0)
    for qtype, (name, _, _) in PACKED_TYPES.items():
        if name == "BF16":
            continue
        weight = packed_gemv.random_weight(qtype, 8, 512, gen)
        assert kernel.dequantize(weight, qtype, 512).isfinite().all(), name
