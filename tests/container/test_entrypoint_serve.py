"""The entrypoint as the CPU container runs it: it serves, and /health turns 200.

Starts ``docker/entrypoint.py`` with the image's environment (HISERVE_DEVICE=cpu, the
default model, the HiCache host tier on), waits for /health, checks the host tier is
reported the way DESIGN.md's table says for a CPU (pageable, not pinned), answers one
request through the official OpenAI client, and stops it with SIGTERM like
`docker stop` does.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "docker" / "entrypoint.py"
STARTUP_TIMEOUT_S = 600.0

pytestmark = pytest.mark.slow


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path) -> tuple[dict, list[int]]:
    """Poll /health until 200; return its JSON and the statuses seen before."""
    statuses: list[int] = []
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            response = httpx.get(f"{url}/health", timeout=5)
        except httpx.HTTPError:
            time.sleep(1)
            continue
        if response.status_code == 200:
            return response.json(), statuses
        statuses.append(response.status_code)
        time.sleep(1)
    pytest.fail(f"/health not 200 within {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def test_cpu_entrypoint_serves(tmp_path: Path) -> None:
    # NOTE: the server inherits this bound socket (--fd, passed through the entrypoint
    # like any server flag): no window between finding a free port and binding it.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    mount = tmp_path / "models"
    mount.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HISERVE_", "MUSA_", "CUDA_", "MTHREADS_"))
    }
    env.update(
        HISERVE_DEVICE="cpu",
        HISERVE_HOST="127.0.0.1",
        HISERVE_PORT=str(port),
        HISERVE_MODEL="",  # empty, as compose passes it: the entrypoint picks the default
        HISERVE_MODEL_MOUNT=str(mount),
        HISERVE_KV_CACHE_TOKENS="1024",
        HISERVE_ENABLE_HIERARCHICAL_CACHE="1",
        HISERVE_HICACHE_RATIO="2",
        HISERVE_HICACHE_HOST_ALLOC="auto",
        HISERVE_MAX_MODEL_LEN="",  # compose's empty default must not break the server
        HISERVE_CACHE_DIR=os.environ.get("HISERVE_CACHE_DIR") or str(tmp_path / "cache"),
    )
    log = tmp_path / "server.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, str(ENTRYPOINT), "--fd", str(sock.fileno())],
            env=env,
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            pass_fds=(sock.fileno(),),
        )
    sock.close()  # the server holds its own copy
    url = f"http://127.0.0.1:{port}"
    try:
        health, before = wait_healthy(url, proc, log)
        assert all(code == 503 for code in before), before  # 503 while loading, never 5xx else
        assert str(health["device"]).startswith("cpu")
        # DESIGN.md section 5: on a CPU the host tier is pageable memory, never pinned.
        assert health["host_alloc_method"] == "pageable"
        assert health["pinned"] is False
        if Path(f"/proc/{proc.pid}/cmdline").exists():  # exec'd: PID 1 in the container
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
            assert b"server" in cmdline and b"-m" in cmdline

        from openai import OpenAI

        client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
        model = client.models.list().data[0].id
        completion = client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=4, temperature=0
        )
        assert completion.usage is not None and completion.usage.completion_tokens >= 1
        assert completion.choices[0].text
    finally:
        proc.send_signal(signal.SIGTERM)  # what `docker stop` sends to PID 1
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    text = log.read_text(errors="replace")
    # A drained stop exits 0 (a kill after the timeout, -9, or a crash would not).
    assert code == 0, text[-4000:]
    assert "[hiserve-entrypoint] device: cpu" in text
    assert "hicache: on" in text
    # The server's startup summary names the host-tier method and whether it is pinned.
    assert "pinned" in text.lower() and "pageable" in text
    assert "Traceback" not in text
