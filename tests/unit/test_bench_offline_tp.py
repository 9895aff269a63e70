"""``python -m bench.offline --tp 2`` runs end to end on a tiny model (CPU, gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import offline


@pytest.mark.slow  # a worker process starts: 10-25 s on a shared 2-core box
def test_offline_bench_runs_with_two_ranks(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    offline.main(
        [
            "--model",
            str(tiny_llama_dir),
            "--num-requests",
            "3",
            "--prompt-len",
            "4",
            "12",
            "--output-len",
            "2",
            "6",
            "--single-tokens",
            "4",
            "--skip-hf",
            "--tp",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert "tp 2 on cpu" in out
    assert "engine  batch of 3:" in out and "engine  single stream:" in out
    assert "matmul floor" not in out  # rank 0 alone cannot replay row-parallel layers
