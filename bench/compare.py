"""``compare``: one workload against several targets, launching local servers as needed.

A target is a URL (``http://host:port`` or ``label=http://...``) or the name of a server
configuration this tool launches on 127.0.0.1 itself, one at a time so they never share
the CPU: ``none`` (no prefix cache), ``radix`` (radix cache only) or ``hicache`` (radix
cache plus the host tier), or ``fleet:POLICY``: ``--replicas`` radix servers behind the
SGLang Model Gateway routing with POLICY (``bench/fleet.py``). Launched servers are
stopped when their run ends, on errors and on Ctrl-C alike.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.fleet import FAST_ROUTER_FLAGS, ROUTER_POLICIES, FleetError, LocalFleet
from bench.runner import RunState

# Server flags of each built-in configuration, added to the shared launch flags.
SERVER_CONFIGS: dict[str, tuple[str, ...]] = {
    "none": ("--disable-radix-cache",),
    "radix": (),
    "hicache": ("--enable-hierarchical-cache",),
}


class ServerLaunchError(RuntimeError):
    """A server this tool launched exited or never became healthy."""


@dataclass(frozen=True)
class Target:
    """Where one column of a comparison comes from: a URL, or a config to launch."""

    label: str
    url: str | None = None  # None: launch SERVER_CONFIGS[config]
    config: str | None = None
    policy: str | None = None  # set: launch a fleet whose router uses this policy


def parse_target(spec: str) -> Target:
    """``radix``, ``hicache``, ``none``, ``http://h:p`` or any of them as ``label=...``."""
    label, sep, value = spec.partition("=")
    if not sep or label.startswith(("http://", "https://")):
        label, value = "", spec
    value = value.strip()
    if value.startswith(("http://", "https://")):
        return Target(label or value, url=value)
    if value in SERVER_CONFIGS:
        return Target(label or value, config=value)
    kind, _, policy = value.partition(":")
    if kind == "fleet" and policy in ROUTER_POLICIES:
        return Target(label or value, config="radix", policy=policy)
    raise ValueError(
        f"target {spec!r} is neither a URL (http://host:port), one of the server "
        f"configurations {', '.join(SERVER_CONFIGS)}, nor fleet:POLICY with a policy "
        f"of {', '.join(ROUTER_POLICIES)}"
    )


@dataclass(frozen=True)
class LaunchOptions:
    """Flags shared by every server this tool launches."""

    model: str = "default"
    device: str = "cpu"
    dtype: str = "float32"
    kv_cache_tokens: int | None = None
    hicache_ratio: float | None = None
    api_key: str | None = None
    extra_args: tuple[str, ...] = ()
    startup_timeout: float = 300.0
    replicas: int = 2  # per fleet target
    router_args: tuple[str, ...] = ()  # extra smg flags of fleet targets
    # The module launched with ``python -m``: the server, or a wrapper that takes its flags
    # (``bench.micro.no_work_server``).
    module: str = "server"


def server_flags(config: str, options: LaunchOptions) -> list[str]:
    """Flags of a launched server (all but where it listens and its key)."""
    flags = [
        "--model",
        options.model,
        "--device",
        options.device,
        "--dtype",
        options.dtype,
        *SERVER_CONFIGS[config],
    ]
    if options.kv_cache_tokens is not None:
        flags += ["--kv-cache-tokens", str(options.kv_cache_tokens)]
    if options.hicache_ratio is not None and config == "hicache":
        flags += ["--hicache-ratio", str(options.hicache_ratio)]
    return flags + list(options.extra_args)


def _bound_socket() -> socket.socket:
    """A socket bound to a free port, handed to the server as it is (``--fd``): a port
    closed here and bound again by the server could be taken by another process between."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


_LIVE_SERVERS: set[LaunchedServer] = set()


def _stop_live_servers() -> None:
    for server in list(_LIVE_SERVERS):
        server.stop()


atexit.register(_stop_live_servers)


class LaunchedServer:
    """A ``python -m server`` child on 127.0.0.1; a context manager that always stops it."""

    def __init__(self, config: str, options: LaunchOptions) -> None:
        self._sock: socket.socket | None = _bound_socket()
        self.port = int(self._sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.options = options
        self.command = [
            sys.executable,
            "-m",
            options.module,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--fd",
            str(self._sock.fileno()),
            *server_flags(config, options),
        ]
        # NOTE: the key goes to the server through its environment (HISERVE_API_KEY), never
        # its command line, which any local user can read with ps.
        self.api_key = options.api_key
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    def __enter__(self) -> LaunchedServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # Make `python -m server` importable from a source checkout that is not installed.
        repo_root = Path(__file__).resolve().parent.parent
        if (repo_root / "server").is_dir():
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(repo_root), env.get("PYTHONPATH", "")) if p
            )
        env.pop("HISERVE_API_KEY", None)
        if self.api_key:
            env["HISERVE_API_KEY"] = self.api_key
        fd, log_name = tempfile.mkstemp(prefix="hiserve-bench-server-", suffix=".log")
        self.log_path = Path(log_name)
        with os.fdopen(fd, "wb") as log:
            # NOTE: its own session, so a Ctrl-C in the terminal reaches only this tool,
            # which then stops the server itself (and a server is never left behind).
            assert self._sock is not None, "a LaunchedServer starts once"
            try:
                self.process = subprocess.Popen(
                    self.command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                    pass_fds=(self._sock.fileno(),),
                )
            finally:
                self._close_socket()  # the child owns it now
        _LIVE_SERVERS.add(self)

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def log_tail(self, lines: int = 15) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").strip().splitlines()
        return "\n".join(f"  server| {line}" for line in text[-lines:])

    def wait_ready(self) -> None:
        """Poll ``/health`` until it answers 200; raise with the server's log otherwise."""
        assert self.process is not None
        headers = (
            {"Authorization": f"Bearer {self.options.api_key}"} if self.options.api_key else {}
        )
        deadline = time.monotonic() + self.options.startup_timeout
        with httpx.Client(timeout=5.0, headers=headers) as http:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise ServerLaunchError(
                        f"server `{' '.join(self.command)}` exited with code "
                        f"{self.process.returncode} before it was ready; its log ends with:\n"
                        f"{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if http.get(f"{self.url}/health").status_code == 200:
                        return
                time.sleep(0.5)
        raise ServerLaunchError(
            f"server on {self.url} was not healthy after {self.options.startup_timeout:.0f} s "
            f"(raise --startup-timeout?); its log ends with:\n{self.log_tail()}"
        )

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``grace`` seconds."""
        process, self.process = self.process, None
        _LIVE_SERVERS.discard(self)
        self._close_socket()
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=grace)
        if process is not None and self.log_path is not None:
            with contextlib.suppress(OSError):
                self.log_path.unlink()

    def __hash__(self) -> int:
        return id(self)


def run_compare(
    targets: Sequence[Target],
    launch: LaunchOptions,
    run_one: Callable[[RunState], object],
    states: list[RunState],
    total_requests: int,
    log: Callable[[str], object] = print,
) -> None:
    """Run each target in turn through ``run_one(state)`` (which fills ``state``).

    Each target's state joins ``states`` before its run starts, so an interrupted
    comparison keeps its partial results. A failed launch is recorded as that target's
    ``aborted`` reason and the comparison moves on to the next target.
    """
    for target in targets:
        state = RunState(target.label, target.url or f"(launch {target.config})", total_requests)
        states.append(state)
        if target.url is not None:
            run_one(state)
            continue
        assert target.config is not None
        if target.policy is not None:
            _run_fleet(target, launch, run_one, state, log)
            continue
        log(f"launching server `{target.config}` ...")
        try:
            with LaunchedServer(target.config, launch) as server:
                log(f"server `{target.config}` is ready on {server.url}")
                state.base_url = server.url
                run_one(state)
        except ServerLaunchError as exc:
            state.aborted = str(exc)


def _run_fleet(
    target: Target,
    launch: LaunchOptions,
    run_one: Callable[[RunState], object],
    state: RunState,
    log: Callable[[str], object],
) -> None:
    """Launch ``launch.replicas`` servers and a router with ``target.policy``, run, stop."""
    assert target.config is not None and target.policy is not None
    if not launch.api_key:
        raise ValueError("fleet targets need an API key (the router and replicas share it)")
    log(f"launching {launch.replicas} replicas behind a `{target.policy}` router ...")
    with tempfile.TemporaryDirectory(prefix="hiserve-bench-fleet-") as log_dir:
        fleet = LocalFleet(
            replicas=launch.replicas,
            policy=target.policy,
            log_dir=Path(log_dir),
            server_args=tuple(server_flags(target.config, launch)),
            api_key=launch.api_key,
            ready_timeout=launch.startup_timeout,
            router_args=(*FAST_ROUTER_FLAGS, *launch.router_args),
        )
        try:
            with fleet:
                log(f"fleet `{target.policy}` is ready on {fleet.url}")
                state.base_url = fleet.url
                run_one(state)
        except FleetError as exc:
            state.aborted = str(exc)
