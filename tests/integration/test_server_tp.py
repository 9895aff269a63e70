"""``python -m server --tp 2``: serves through the official client, reports the group in
/health, and exits non-zero (after /health turned unhealthy) when a worker rank dies."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.conftest import ServerProcess, wait_until


def _worker_pids(log: str) -> list[int]:
    """The tensor-parallel workers' pids, as the start-up log names them (the server has
    other spawned children too: the grammar compile workers)."""
    match = re.search(r"tensor parallel: \d+ ranks on .*, workers \[([\d, ]+)\]", log)
    assert match is not None, "the start-up log names no tensor-parallel workers"
    return [int(pid) for pid in match.group(1).split(",")]


def _unhealthy(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/health", timeout=2.0).status_code != 200
    except httpx.HTTPError:
        return True  # already gone


@pytest.mark.slow  # a server and a worker process start: 15-40 s on a shared 2-core box
def test_tp_server_serves_and_exits_nonzero_when_a_rank_dies(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    server = ServerProcess(
        tmp_path / "server.log",
        ["--model", str(tiny_llama_dir), "--tp", "2", "--kv-cache-tokens", "512"],
    )
    try:
        server.wait_ready()
        health = httpx.get(
            server.base_url + "/health", headers=server.headers(), timeout=5.0
        ).json()
        assert health["tensor_parallel_size"] == 2
        client = openai.OpenAI(
            base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0
        )
        out = client.completions.create(
            model=client.models.list().data[0].id, prompt="Hello", max_tokens=4, temperature=0
        )
        assert out.usage is not None and out.usage.completion_tokens == 4
        workers = _worker_pids(server.log_text())
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        assert wait_until(lambda: _unhealthy(server.base_url), timeout=60)
        code = server.proc.wait(timeout=120)
        assert code != 0
        log = server.log_text()
        assert "tensor-parallel rank 1" in log and "exited with code" in log
    finally:
        server.stop()
