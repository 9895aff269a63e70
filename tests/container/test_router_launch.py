"""docker/router_launch.py, the router image's entrypoint (issue 25 item 10): the keys
reach smg from files or the environment, never through a command line.

Run as the container runs it: once with smg's start replaced by a recorder (a
``sitecustomize`` on the child's path) that writes down what the process's own
``/proc`` shows and what smg was given, and once with the real smg, whose control plane
must then take the admin key from the file and refuse everything else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.fleet import free_port
from tests.container.compose_file import router_launch

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "docker" / "router_launch.py"
ADMIN, CLIENT = "adm-9f2c61e0-secret", "cli-77d1a4b3-secret"
RECORDER = """
import json, os, sys
import smg.launch_router as launch_module

def record(router_args):
    with open(os.environ["RECORD_TO"], "w") as out:
        json.dump({
            "cmdline": open("/proc/self/cmdline", "rb").read().decode(errors="replace"),
            "environ": open("/proc/self/environ", "rb").read().decode(errors="replace"),
            "os_environ": dict(os.environ),
            "api_key": router_args.api_key,
            "tenant_api_keys": [list(k) for k in router_args.tenant_api_keys],
            "control_plane_api_keys": [list(k) for k in router_args.control_plane_api_keys],
            "worker_urls": router_args.worker_urls,
            "policy": router_args.policy,
        }, out)

launch_module.launch_router = record
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUTER_")}
    return {**env, **extra}


@pytest.fixture()
def recorder(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(RECORDER)
    return site


def _run_recorded(
    recorder: Path, tmp_path: Path, args: list[str], **env: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    record = tmp_path / "record.json"
    done = subprocess.run(
        [sys.executable, str(LAUNCHER), *args],
        env=_env(PYTHONPATH=str(recorder), RECORD_TO=str(record), **env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done, (json.loads(record.read_text()) if record.exists() else {})


def test_keys_from_files_reach_smg_and_nothing_else(recorder: Path, tmp_path: Path) -> None:
    (tmp_path / "admin").write_text(ADMIN + "\n")
    (tmp_path / "client").write_text(CLIENT)
    done, seen = _run_recorded(
        recorder,
        tmp_path,
        ["--host", "127.0.0.1", "--policy", "round_robin"],
        ROUTER_ADMIN_KEY_FILE=str(tmp_path / "admin"),
        ROUTER_API_KEY_FILE=str(tmp_path / "client"),
        ROUTER_WORKER_URLS="http://a:8000 http://b:8000",
    )
    assert done.returncode == 0, done.stderr
    assert seen["api_key"] == ADMIN
    assert seen["tenant_api_keys"] == [["clients", CLIENT]]
    assert [k[2:] for k in seen["control_plane_api_keys"]] == [[ADMIN, "admin"]]
    assert seen["worker_urls"] == ["http://a:8000", "http://b:8000"]
    assert seen["policy"] == "round_robin"
    # what `ps` and /proc show of the process that runs smg: no key anywhere
    for where in ("cmdline", "environ"):
        assert ADMIN not in seen[where] and CLIENT not in seen[where], where
    assert "--host" in seen["cmdline"]  # the recorder did read the real command line


def test_keys_from_the_environment_leave_it(recorder: Path, tmp_path: Path) -> None:
    done, seen = _run_recorded(
        recorder, tmp_path, ["--host", "127.0.0.1"], ROUTER_ADMIN_KEY=ADMIN, ROUTER_API_KEY=CLIENT
    )
    assert done.returncode == 0, done.stderr
    assert seen["api_key"] == ADMIN and seen["tenant_api_keys"] == [["clients", CLIENT]]
    assert ADMIN not in seen["cmdline"] and CLIENT not in seen["cmdline"]
    # popped before smg starts: nothing smg spawns inherits them
    assert "ROUTER_ADMIN_KEY" not in seen["os_environ"]
    assert "ROUTER_API_KEY" not in seen["os_environ"]


def test_client_key_alone_is_the_routers_key_with_a_warning(recorder: Path, tmp_path: Path) -> None:
    done, seen = _run_recorded(recorder, tmp_path, [], ROUTER_API_KEY=CLIENT)
    assert done.returncode == 0, done.stderr
    assert seen["api_key"] == CLIENT and seen["control_plane_api_keys"] == []
    assert "admin routes" in done.stderr
    done, seen = _run_recorded(recorder, tmp_path, [])  # no key at all: no key flags
    assert done.returncode == 0, done.stderr
    assert seen["api_key"] is None and seen["tenant_api_keys"] == []


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--api-key", "x"], {}, "--api-key on the command line"),
        (["--tenant-api-key=t:x"], {}, "--tenant-api-key on the command line"),
        ([], {"ROUTER_ADMIN_KEY": "a", "ROUTER_ADMIN_KEY_FILE": "/dev/null"}, "not both"),
        ([], {"ROUTER_API_KEY_FILE": "/nonexistent/key"}, "cannot read"),
        ([], {"ROUTER_API_KEY_FILE": "/dev/null"}, "is empty"),
    ],
)
def test_refused_settings_say_why(
    recorder: Path, tmp_path: Path, args: list[str], env: dict[str, str], message: str
) -> None:
    done, seen = _run_recorded(recorder, tmp_path, args, **env)
    assert done.returncode == 2 and seen == {}
    assert message in done.stderr
    assert "x" not in done.stderr.split(message)[-1].split()  # no key echoed


def test_parse_matches_the_shell_it_replaced() -> None:
    """The flags the compose file's shell used to build, now built in-process."""
    launcher = router_launch()
    flags, warning = launcher.key_flags("c", "a")
    assert flags == [
        "--api-key",
        "a",
        "--control-plane-api-keys",
        "fleet-admin:fleet admin:admin:a",
        "--tenant-api-key",
        "clients:c",
    ]
    assert warning is None
    assert launcher.key_flags("", "") == ([], None)


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs Linux /proc")
def test_the_real_router_takes_the_admin_key_from_its_file(tmp_path: Path) -> None:
    (tmp_path / "admin").write_text(ADMIN)
    port, metrics = free_port(), free_port()
    dead_worker = f"http://127.0.0.1:{free_port()}"
    log = (tmp_path / "router.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, str(LAUNCHER), "--host", "127.0.0.1", "--port", str(port),
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
         "--worker-urls", dead_worker],
        env=_env(ROUTER_ADMIN_KEY_FILE=str(tmp_path / "admin")),
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}/workers"
        deadline = time.monotonic() + 60
        while True:
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
            assert ADMIN.encode() not in cmdline
            try:
                answer = httpx.get(url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=2)
                break
            except httpx.HTTPError:
                assert proc.poll() is None, (tmp_path / "router.log").read_text()
                assert time.monotonic() < deadline, "the router did not start"
                time.sleep(0.2)
        assert answer.status_code == 200, answer.text
        assert httpx.get(url, timeout=5).status_code == 401
        wrong = {"Authorization": "Bearer not-the-key"}
        assert httpx.get(url, headers=wrong, timeout=5).status_code == 401
        assert ADMIN.encode() not in Path(f"/proc/{proc.pid}/environ").read_bytes()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
