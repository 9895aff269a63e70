"""bench.l3 end to end on a tiny model: the table it prints, and the figures that are exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import l3


def test_bench_l3_prints_the_table(tiny_llama_dir: Path, capsys: pytest.CaptureFixture) -> None:
    l3.main(
        ["--model", str(tiny_llama_dir), "--backends", "none", "file", "--prompts", "2",
         "--prefix-len", "40", "--rounds", "2", "--page-size", "4", "--kv-cache-tokens", "512"]
    )  # fmt: skip
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| L3 backend |")
    cells = {row.split("|")[1].strip(): row.split("|")[2:-1] for row in rows[1:]}
    # After a restart without a store nothing is cached; with one, every stored page is.
    assert float(cells["none"][0]) == 0.0
    assert float(cells["file"][0]) == 1.0
    # Round-robin replicas: every round after the first finds its history in the store.
    assert float(cells["file"][2]) == 1.0
    assert float(cells["none"][3]) == 1.0  # the baseline is the first backend listed
