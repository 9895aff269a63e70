"""``python -m server --tp 2``: serves through the official client, reports the group in
/health, and, when a worker rank dies in the middle of a generation, turns /health
unhealthy and exits non-zero within 30 s (the stream in flight ends with an error)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
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
@pytest.mark.parametrize("engine_flags", [[], ["--engine-process"]], ids=["thread", "process"])
def test_tp_server_serves_and_exits_nonzero_when_a_rank_dies(
    tmp_path: Path, tiny_llama_dir: Path, engine_flags: list[str]
) -> None:
    """With --engine-process, rank 0 runs in the engine's own process and starts the
    other ranks from there; a dead rank still ends the server within 30 s."""
    server = ServerProcess(
        tmp_path / "server.log",
        ["--model", str(tiny_llama_dir), "--tp", "2", "--kv-cache-tokens", "1024", *engine_flags],
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
        streaming = threading.Event()
        ended: list[str] = []

        def generate() -> None:  # a long stream; the rank dies in the middle of it
            try:
                stream = client.completions.create(
                    model=out.model,
                    prompt="Once upon a time",
                    max_tokens=900,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for _ in stream:
                    streaming.set()
                ended.append("complete")
            except Exception as exc:  # the error the server sends when the engine dies
                ended.append(type(exc).__name__)
            finally:
                streaming.set()

        reader = threading.Thread(target=generate, daemon=True)
        reader.start()
        assert streaming.wait(timeout=60) and not ended, "the stream never started"
        os.kill(workers[0], signal.SIGKILL)
        killed = time.monotonic()
        assert wait_until(lambda: _unhealthy(server.base_url), timeout=30)
        code = server.proc.wait(timeout=max(1.0, 30 - (time.monotonic() - killed)))
        assert code != 0
        reader.join(timeout=10)
        assert ended and ended[0] != "complete", ended
        log = server.log_text()
        assert "tensor-parallel rank 1" in log and "exited with code" in log
    finally:
        server.stop()
