"""A local fleet on 127.0.0.1: N ``hiserve`` replicas behind one SGLang Model Gateway.

Used by ``hiserve-bench --compare-policies`` and by the fleet integration tests. The
router is the real ``smg`` (``pip install 'hiserve[fleet]'``), never a stand-in.

Ports: each process gets a port that was free a moment ago. Another process may take it
in between, so every replica and the router is started with fresh random keys and counts
as ours only once an authenticated call with the admin key succeeds; a process that
cannot bind exits, and is started again on another port.

Keys: clients hold ``api_key``; the router and the replicas share ``admin_key``. The router
checks ``api_key`` as a tenant key on the serving routes and forwards it to the replica,
which checks it as its client key; its admin routes (``/workers``, ``/flush_cache``, ...)
take ``admin_key`` only, which is also what it sends on its own probes of the replicas
(smg's ``--api-key``), where it opens ``/server_info``, ``/v1/loads`` and ``/flush_cache``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

HOST = "127.0.0.1"
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "least_load")
# NOTE: smg 1.13.0 with retries on holds a request whose replica died under it until the
# client gives up (seen: 120 s); with --disable-retries it ends at once with a 500 that
# names the replica. The router only sends work to replicas that pass /health, so its
# retries have little else to do. Health is probed every second, so a dead replica leaves
# the rotation within seconds (the defaults, 60 s x 3, take minutes).
FAST_ROUTER_FLAGS = (
    "--disable-retries",
    "--health-check-interval-secs",
    "1",
    "--health-failure-threshold",
    "1",
    "--health-success-threshold",
    "1",
    "--load-monitor-interval",
    "1",
)
# The routing thresholds docker-compose.yml and the Kubernetes router ship beside
# cache_aware (docs/fleet.md, "Affinity and balance"): two requests more on one replica
# than on the other, and 1.3x its load, send the next request to the less loaded one.
SHIPPED_BALANCE_FLAGS = (
    "--cache-threshold",
    "0.3",
    "--balance-abs-threshold",
    "1",
    "--balance-rel-threshold",
    "1.3",
)
# What docker-compose.yml and the Kubernetes router ship for a replica's death
# (docs/fleet.md, "When a replica dies"; tests/container checks they agree): a refused
# request is retried on a live replica, the breaker drops a replica after 2 failures
# and tries it again after 5 s, health is probed every 2 s.
SHIPPED_FAULT_FLAGS = (
    "--retry-max-retries",
    "3",
    "--retry-initial-backoff-ms",
    "50",
    "--retry-max-backoff-ms",
    "500",
    "--cb-failure-threshold",
    "2",
    "--cb-success-threshold",
    "1",
    "--cb-timeout-duration-secs",
    "5",
    "--cb-window-duration-secs",
    "30",
    "--health-check-interval-secs",
    "2",
    "--health-check-timeout-secs",
    "3",
    "--health-failure-threshold",
    "2",
    "--health-success-threshold",
    "1",
)
START_ATTEMPTS = 3


class FleetError(RuntimeError):
    """A replica or the router did not come up; the message carries its log tail."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def smg_command() -> list[str]:
    """How to run the router: the ``smg`` next to this interpreter, else on PATH."""
    local = Path(sys.executable).with_name("smg")
    found = str(local) if local.exists() else shutil.which("smg")
    if found is None:
        raise FleetError(
            "the SGLang Model Gateway is not installed: pip install 'hiserve[fleet]' "
            "(it provides the `smg` command)"
        )
    return [found, "launch"]


@dataclass
class Process:
    """One child process and where its output goes."""

    name: str
    log_path: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def spawn(
        self, args: list[str], env: dict[str, str] | None = None, hidden: tuple[str, ...] = ()
    ) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        shown = " ".join(args)
        for secret in hidden:
            shown = shown.replace(secret, "***")
        with self.log_path.open("ab") as log:
            log.write(f"\n=== {shown}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**_child_env(), **(env or {})},
                start_new_session=True,  # a Ctrl-C in the terminal goes to the bench only
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: the process dies at once, with whatever it had in flight."""
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited after ``timeout`` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # `python -m server` from a source checkout that is not installed
    repo_root = Path(__file__).resolve().parent.parent
    if (repo_root / "server").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(repo_root), env.get("PYTHONPATH", "")) if p
        )
    return env


def _get(url: str, api_key: str, timeout: float = 2.0) -> httpx.Response | None:
    try:
        return httpx.get(url, headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout)
    except httpx.HTTPError:
        return None


@dataclass
class LocalFleet:
    """N replicas (``python -m server``) and ``smg launch`` in front of them."""

    replicas: int
    policy: str
    log_dir: Path
    server_args: Sequence[str] = ()
    router_args: Sequence[str] = FAST_ROUTER_FLAGS
    api_key: str = field(default_factory=lambda: "fleet-" + secrets.token_hex(12))
    admin_key: str = field(default_factory=lambda: "fleet-admin-" + secrets.token_hex(12))
    ready_timeout: float = 600.0
    workers: list[Process] = field(init=False)
    router: Process = field(init=False)
    extra_routers: list[Process] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"a fleet needs at least one replica, got {self.replicas}")
        self.workers = [
            Process(f"replica-{i}", self.log_dir / f"replica-{i}.log") for i in range(self.replicas)
        ]
        self.router = Process("router", self.log_dir / "router.log")

    @property
    def url(self) -> str:
        return self.router.url

    # ------------------------------------------------------------------ replicas
    def _spawn_replica(self, worker: Process, port: int) -> None:
        worker.port = port
        worker.spawn(
            [
                sys.executable,
                "-m",
                "server",
                *self.server_args,
                "--host",
                HOST,
                "--port",
                str(port),
            ],
            # NOTE: keys through the environment, which `ps` does not show.
            env={"HISERVE_API_KEY": self.api_key, "HISERVE_ADMIN_KEY": self.admin_key},
        )

    def _replica_ready(self, worker: Process) -> bool:
        # /server_info needs our admin key: a 200 proves the port is ours and the model loaded.
        response = _get(worker.url + "/server_info", self.admin_key)
        return response is not None and response.status_code == 200

    def _await_replicas(self, workers: list[Process], same_port: bool) -> None:
        attempts = dict.fromkeys(range(len(workers)), 1)
        deadline = time.monotonic() + self.ready_timeout
        pending = list(range(len(workers)))
        while pending:
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- {workers[i].name}\n{workers[i].log_tail()}" for i in pending
                )
                self.stop()
                raise FleetError(f"replicas not ready after {self.ready_timeout:.0f} s:\n{tails}")
            for i in list(pending):
                worker = workers[i]
                if self._replica_ready(worker):
                    pending.remove(i)
                elif not worker.alive():
                    if same_port or attempts[i] >= START_ATTEMPTS:
                        tail = worker.log_tail()
                        self.stop()
                        raise FleetError(f"{worker.name} exited while starting:\n{tail}")
                    attempts[i] += 1  # most likely its port was taken: try another
                    self._spawn_replica(worker, free_port())
            time.sleep(0.5)

    def kill_replica(self, index: int) -> None:
        self.workers[index].kill()

    def restart_replica(self, index: int) -> None:
        """Start a killed or stopped replica again on its old port; wait until it serves."""
        worker = self.workers[index]
        if worker.alive():
            raise FleetError(f"{worker.name} is still running")
        self._spawn_replica(worker, worker.port)
        self._await_replicas([worker], same_port=True)

    # ------------------------------------------------------------------ router
    def _spawn_router(self, router: Process, policy: str) -> None:
        router.port = free_port()
        prometheus_port = free_port()
        router.spawn(
            [
                *smg_command(),
                "--worker-urls",
                *(w.url for w in self.workers),
                "--policy",
                policy,
                "--host",
                HOST,
                "--port",
                str(router.port),
                # what it sends to the replicas, which take it as their admin key
                "--api-key",
                self.admin_key,
                # the clients' key (smg has no separate listener for admin routes)
                "--tenant-api-key",
                f"clients:{self.api_key}",
                "--control-plane-api-keys",
                f"fleet-admin:fleet admin:admin:{self.admin_key}",
                # its metrics listener defaults to 0.0.0.0:29000: keep it local and free
                "--prometheus-host",
                HOST,
                "--prometheus-port",
                str(prometheus_port),
                *self.router_args,
            ],
            hidden=(self.api_key, self.admin_key),
        )

    def healthy_workers(self, router: Process | None = None) -> set[str]:
        """URLs of the replicas the router (default: the main one) currently routes to."""
        router = router or self.router
        response = _get(router.url + "/workers", self.admin_key)
        if response is None or response.status_code != 200:
            return set()
        return {w["url"] for w in response.json().get("workers", []) if w.get("is_healthy")}

    def wait_healthy(
        self, urls: set[str], timeout: float = 120.0, router: Process | None = None
    ) -> None:
        """Wait until the router (default: the main one) routes to exactly ``urls``."""
        router = router or self.router
        deadline = time.monotonic() + timeout
        while self.healthy_workers(router) != urls:
            if not router.alive():
                raise FleetError(f"{router.name} exited:\n{router.log_tail()}")
            if time.monotonic() > deadline:
                raise FleetError(
                    f"{router.name} sees {sorted(self.healthy_workers(router))}, want "
                    f"{sorted(urls)} after {timeout:.0f} s:\n{router.log_tail()}"
                )
            time.sleep(0.25)

    def _await_router(self, router: Process, policy: str) -> None:
        for attempt in range(1, START_ATTEMPTS + 1):
            self._spawn_router(router, policy)
            try:
                self.wait_healthy({w.url for w in self.workers}, router=router)
                return
            except FleetError:
                if router.alive() or attempt == START_ATTEMPTS:
                    raise
                # exited: most likely a port was taken, so try other ports

    def add_router(self, policy: str) -> Process:
        """A second router with another policy in front of the same replicas."""
        router = Process(f"router-{policy}", self.log_dir / f"router-{policy}.log")
        self.extra_routers.append(router)
        self._await_router(router, policy)
        return router

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> LocalFleet:
        self.start_replicas()
        try:
            self._await_router(self.router, self.policy)
        except BaseException:
            self.stop()
            raise
        return self

    def start_replicas(self) -> LocalFleet:
        """Start the replicas only, without a router (clients call each one directly)."""
        try:
            for worker in self.workers:
                self._spawn_replica(worker, free_port())
            self._await_replicas(self.workers, same_port=False)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for router in [self.router, *self.extra_routers]:
            router.stop(timeout=10.0)
        for worker in self.workers:
            worker.stop()

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
