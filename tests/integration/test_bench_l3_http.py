"""``hiserve-bench l3`` end to end: real server processes on a tiny model, few requests.

The figures that are exact on any machine are checked: after a restart the store serves
every full page of every document (none without a store); with two replicas in
round-robin and two rounds, the second round finds its whole history in the store (and
nothing without one: its replica never saw the conversation). TTFT and tokens/s are
only checked to be measured.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import __main__ as bench_cli
from bench.l3_http import L3Options, run_backend

pytestmark = pytest.mark.slow

TINY = dict(
    kv_cache_tokens=512, page_size=4, documents=2, doc_len=40, question_len=8,
    conversations=2, rounds=2, turn_len=8, decode_requests=2, decode_tokens=4,
)  # fmt: skip


def test_without_a_store_nothing_survives_a_restart_or_crosses_replicas(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    options = L3Options(model=str(tiny_llama_dir), **TINY)  # type: ignore[arg-type]
    result = run_backend("none", options, tmp_path)
    assert result.restart_hit == 0.0
    assert result.replicas_hit == 0.0
    assert result.ttft_cold_s > 0 and result.ttft_warm_s > 0
    assert result.output_tok_s > 0


def test_with_a_file_store_restarts_and_replicas_hit_every_stored_page(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = ["l3", "--model", str(tiny_llama_dir), "--backends", "file", "--log-dir", str(tmp_path)]
    for name, value in TINY.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    assert bench_cli.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| L3 backend | restart: hit / ideal |")
    cells = [c.strip() for c in rows[1].split("|")[1:-1]]
    assert cells[0] == "file"
    assert float(cells[1]) == 1.0  # restart: every full page of every document
    assert float(cells[5]) == 1.0  # replicas: round 2 finds all of round 1's history
    assert float(cells[2]) > 0 and float(cells[3]) > 0 and float(cells[6]) > 0
    assert float(cells[7]) == 1.0  # the first backend listed is its own baseline
    assert (tmp_path / "file" / "replica-0.log").exists()
