"""Fixtures: a real ``python -m server`` subprocess on the default model, clients, helpers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import uvicorn

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
# Small and fast on a 2-core CPU box.
SMALL_ENGINE_FLAGS = [
    "--model",
    "default",
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--kv-cache-tokens",
    "4096",
    "--max-running-requests",
    "64",
]
READY_TIMEOUT_S = 300.0  # the first start converts the GGUF model (~20 s); then ~5 s


def free_port() -> int:
    """A port that was free a moment ago. Racy (another process may take it before the
    caller binds it): servers here get a bound socket instead (``bound_socket``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bound_socket() -> socket.socket:
    """A TCP socket bound to a free port on 127.0.0.1, to hand to a server as it is."""
    # NOTE: IPPROTO_TCP named, not 0: asyncio turns Nagle off (TCP_NODELAY) only on
    # accepted sockets whose Python object says proto 6, and an in-thread uvicorn accepts
    # on this very object. Without it a response's small writes wait ~40 ms for the
    # client's delayed ACK whenever a client sent its request in two segments.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    return sock


def refuses_connections(base_url: str) -> bool:
    """True once nothing listens at ``base_url`` any more."""
    try:
        httpx.get(base_url + "/health", timeout=2.0)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        pass
    return False


class ServerProcess:
    """``python -m server`` in a subprocess, its output captured to ``log_path``."""

    def __init__(
        self,
        log_path: Path,
        extra_args: list[str] | None = None,
        api_key: str | None = API_KEY,
        env: dict[str, str] | None = None,
    ) -> None:
        # NOTE: the server inherits this bound socket (--fd); no bind-close-rebind window.
        sock = bound_socket()
        self.port = int(sock.getsockname()[1])
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        args = [
            sys.executable,
            "-m",
            "server",
            *SMALL_ENGINE_FLAGS,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--fd",
            str(sock.fileno()),
            *(extra_args or []),
        ]
        if api_key:
            args += ["--api-key", api_key]
        self.log_path = log_path
        self.log = log_path.open("wb")  # closed in stop()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        try:
            self.proc = subprocess.Popen(
                args,
                cwd=REPO,
                stdout=self.log,
                stderr=subprocess.STDOUT,
                env=full_env,
                pass_fds=(sock.fileno(),),
            )
        finally:
            # The child owns the socket now; our copy would keep the port accepting
            # (queueing connections) after the server closed it.
            sock.close()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}"
                )
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout} s:\n{self.log_text()[-4000:]}")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int:
        self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.log.close()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class ThreadServer:
    """An in-process app served by uvicorn in a background thread (fake-engine tests)."""

    def __init__(self, app: Any, config: uvicorn.Config | None = None, **config_kw: Any) -> None:
        # NOTE: uvicorn serves this bound socket as it is; no bind-close-rebind window.
        self.sock = bound_socket()
        self.port = int(self.sock.getsockname()[1])
        self.base_url = f"http://127.0.0.1:{self.port}"
        if config is None:
            config = uvicorn.Config(
                app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                lifespan="on",
                **config_kw,
            )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("in-thread uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("server") / "server.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        code = proc.stop()
        # A clean drain: SIGTERM ends the server with status 0.
        assert code == 0, f"server exited with {code}:\n{proc.log_text()[-4000:]}"


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120.0
    )


@pytest.fixture(scope="session")
def async_client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120.0
    )


@pytest.fixture(scope="session")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=server.headers(), timeout=120.0) as session:
        yield session


@pytest.fixture(scope="session")
def ref_engine(server: ServerProcess) -> Any:
    """The synchronous Engine on the same model and settings, as the greedy reference.

    Depends on ``server`` so that the first-time model conversion is finished before it
    loads (no two processes convert into the cache at once).
    """
    from engine import Engine, EngineConfig

    return Engine(
        EngineConfig(
            model="default",
            device="cpu",
            dtype="float32",
            kv_cache_tokens=4096,
            max_running_requests=64,
        )
    )


def metric_value(text: str, name: str, labels: str = "") -> float:
    """Value of one sample in a Prometheus exposition (``labels`` as written, e.g.
    ``tier="device"``)."""
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == wanted:
            return float(value)
    raise KeyError(wanted)


@pytest.fixture(scope="session")
def tools() -> SimpleNamespace:
    """Helpers for test modules (conftest is not importable as a module under pytest)."""
    return SimpleNamespace(
        ServerProcess=ServerProcess,
        ThreadServer=ThreadServer,
        wait_until=wait_until,
        metric_value=metric_value,
        free_port=free_port,
        bound_socket=bound_socket,
        refuses_connections=refuses_connections,
    )
