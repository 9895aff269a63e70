"""Compose hardening: every long-running service drops all capabilities, cannot gain
privileges, runs from a read-only image with a tmpfs /tmp, and writes only to its volumes;
and no API key is ever put on a command line (ps shows every process's arguments)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.container.compose_file import resolve

ROOT = Path(__file__).resolve().parents[2]
ONE_SHOT = ("bench", "bench-cpu")


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return resolve(yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"])


def test_long_running_services_are_locked_down(services: dict[str, Any]) -> None:
    for name, svc in services.items():
        if name in ONE_SHOT:
            continue
        assert svc.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in svc.get("security_opt", []), name
        assert svc.get("read_only") is True, name
        assert "/tmp" in svc.get("tmpfs", []), name


def test_servers_write_only_to_volumes_and_tmp(services: dict[str, Any]) -> None:
    for name, svc in services.items():
        env = svc.get("environment", {})
        if "HISERVE_PORT" not in env or name in ONE_SHOT:
            continue
        targets = {v.split(":")[1] for v in svc["volumes"] if not v.endswith(":ro")}
        assert {"/var/cache/hiserve", "/var/lib/hiserve/l3"} <= targets, name
        assert env["XDG_CACHE_HOME"].startswith("/tmp/"), name


def test_the_bench_key_comes_from_the_environment(services: dict[str, Any]) -> None:
    for name in ONE_SHOT:
        assert "--api-key" not in services[name]["command"], name
        assert "HISERVE_API_KEY" in services[name]["environment"], name


def test_bench_takes_its_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.__main__ as bench_main

    monkeypatch.setenv("HISERVE_API_KEY", "sk-from-env")
    args = bench_main.build_parser().parse_args(["run", "--base-url", "http://x"])
    assert args.api_key == "sk-from-env"


def test_a_launched_server_gets_its_key_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import compare

    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def popen(command: list[str], **kwargs: Any) -> None:
        seen.update(command=command, env=kwargs["env"])
        raise Stop

    monkeypatch.setattr(compare.subprocess, "Popen", popen)
    server = compare.LaunchedServer("radix", compare.LaunchOptions(api_key="sk-secret"))
    with pytest.raises(Stop):
        server.start()
    server.stop()
    assert "sk-secret" not in " ".join(seen["command"])
    assert "--api-key" not in seen["command"]
    assert seen["env"]["HISERVE_API_KEY"] == "sk-secret"
