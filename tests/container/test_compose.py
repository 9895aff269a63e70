"""docker-compose.yml has the structure a MUSA host needs (no Docker engine here): the
MUSA and CPU servers, the load-test services, and .env.example.

Values are checked after resolving ``${VAR:-default}`` to the defaults, i.e. what
`docker compose up` uses without a .env file. Flag names and choices are checked
against the server's own argument table and the engine's config, not against copies.
The fleet, L3 and tensor-parallel services: test_compose_fleet.py.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from bench.__main__ import build_parser as bench_parser
from engine.config import HICACHE_HOST_ALLOC, HICACHE_MEM_LAYOUTS, HICACHE_WRITE_POLICIES
from server.args import FLAG_TABLE
from tests.container.compose_file import (
    COMPOSE,
    ENTRYPOINT_VARS,
    ENV_EXAMPLE,
    ROOT,
    SERVERS,
    VAR_RE,
    compose_vars,
    resolve,
)


def test_services_and_profiles(services: dict[str, Any]) -> None:
    assert set(services) >= {"hiserve", "hiserve-cpu", "bench", "bench-cpu"}
    # `docker compose up` (no profile) starts exactly the MUSA server.
    default_on = [name for name, svc in services.items() if not svc.get("profiles")]
    assert default_on == ["hiserve"]
    assert "cpu" in services["hiserve-cpu"]["profiles"]
    assert services["bench"]["profiles"] == ["bench"]
    # bench-cpu's dependency must be enabled by bench-cpu's own profile.
    assert set(services["bench-cpu"]["profiles"]) <= set(services["hiserve-cpu"]["profiles"])


def test_musa_service_reaches_the_gpu(services: dict[str, Any]) -> None:
    svc = services["hiserve"]
    env = svc["environment"]
    assert svc["runtime"] == "mthreads"
    assert env["MTHREADS_VISIBLE_DEVICES"] == "all"
    assert env["MTHREADS_DRIVER_CAPABILITIES"] == "compute,utility"
    assert env["HISERVE_DEVICE"].startswith("musa")
    assert svc["ipc"] == "host"
    memlock = svc["ulimits"]["memlock"]
    limits = memlock.values() if isinstance(memlock, dict) else [memlock]
    assert all(int(v) == -1 for v in limits)
    assert svc["build"]["dockerfile"] == "Dockerfile.musa"
    # The render group's gid differs between host and image: the default is a number.
    assert "video" in svc["group_add"]
    assert any(resolve(str(g)).isdigit() for g in svc["group_add"]), svc["group_add"]


def test_cpu_service_uses_the_cpu_image(services: dict[str, Any]) -> None:
    svc = services["hiserve-cpu"]
    assert "runtime" not in svc
    assert svc["environment"]["HISERVE_DEVICE"] == "cpu"
    assert svc["build"]["dockerfile"] == "docker/Dockerfile.cpu"
    assert not any(k.startswith("MTHREADS_") for k in svc["environment"])


@pytest.mark.parametrize("name", SERVERS)
def test_server_basics(services: dict[str, Any], name: str) -> None:
    svc = services[name]
    assert (ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
    env = svc["environment"]
    assert env["HISERVE_HOST"] == "0.0.0.0"
    container_port = env["HISERVE_PORT"]
    assert any(str(p).endswith(f":{container_port}") for p in svc["ports"])
    model_mounts = [v for v in svc["volumes"] if v.split(":")[1:] == ["/models", "ro"]]
    assert len(model_mounts) == 1, "model volume must be mounted read-only at /models"
    check = svc["healthcheck"]
    assert check["test"][0] == "CMD" and "/opt/hiserve/healthcheck.py" in check["test"]
    assert int(check["start_period"].rstrip("s")) >= 300  # model loading takes minutes
    assert int(check["retries"]) >= 3


@pytest.mark.parametrize("name", SERVERS)
def test_server_environment_maps_to_real_flags(services: dict[str, Any], name: str) -> None:
    env = services[name]["environment"]
    flag_envs = {spec.env for spec in FLAG_TABLE}
    hiserve_keys = {k for k in env if k.startswith("HISERVE_")}
    assert hiserve_keys - flag_envs - ENTRYPOINT_VARS == set(), "unknown HISERVE_* variables"
    wanted = {
        "MODEL",
        "DEVICE",
        "DTYPE",
        "HOST",
        "PORT",
        "API_KEY",
        "KV_CACHE_TOKENS",
        "KV_MEM_FRACTION",
        "PAGE_SIZE",
        "MAX_RUNNING_REQUESTS",
        "MAX_PREFILL_TOKENS",
        "CHUNKED_PREFILL_SIZE",
        "SCHEDULE_POLICY",
        "ENABLE_HIERARCHICAL_CACHE",
        "HICACHE_RATIO",
        "HICACHE_SIZE",
        "HICACHE_MEM_LAYOUT",
        "HICACHE_WRITE_POLICY",
        "HICACHE_HOST_ALLOC",
        "LOG_LEVEL",
        "SERVED_MODEL_NAME",
        "MAX_MODEL_LEN",
        "TENSOR_PARALLEL_SIZE",
    }
    assert {f"HISERVE_{w}" for w in wanted} <= hiserve_keys
    assert int(env["HISERVE_TENSOR_PARALLEL_SIZE"]) == 1  # one GPU unless asked for more


@pytest.mark.parametrize("name", SERVERS)
def test_hicache_on_by_default_with_valid_settings(services: dict[str, Any], name: str) -> None:
    env = services[name]["environment"]
    assert env["HISERVE_ENABLE_HIERARCHICAL_CACHE"] in ("1", "true")
    assert float(env["HISERVE_HICACHE_RATIO"]) > 0
    assert env["HISERVE_HICACHE_MEM_LAYOUT"] in HICACHE_MEM_LAYOUTS
    assert env["HISERVE_HICACHE_WRITE_POLICY"] in HICACHE_WRITE_POLICIES
    assert env["HISERVE_HICACHE_HOST_ALLOC"] in HICACHE_HOST_ALLOC


@pytest.mark.parametrize(("bench", "server"), [("bench", "hiserve"), ("bench-cpu", "hiserve-cpu")])
def test_bench_runs_against_healthy_server(
    services: dict[str, Any], bench: str, server: str
) -> None:
    svc = services[bench]
    assert svc["depends_on"][server]["condition"] == "service_healthy"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}
    assert mounts.get("/results") == "./bench-results"
    command = svc["command"]
    assert command[0] == "hiserve-bench"
    assert 'hiserve-bench = "bench.__main__:main"' in (ROOT / "pyproject.toml").read_text()
    args = bench_parser().parse_args(command[1:])  # the real CLI accepts these arguments
    assert args.json_path.startswith("/results/") and args.plot_path.startswith("/results/")
    # The URL names a host the server answers to on the compose network.
    host = args.base_url.split("//")[1].split(":")[0]
    aliases = services[server]["networks"]["default"]["aliases"]
    assert host in [server, *aliases]
    assert svc["image"] == services[server]["image"]


def test_every_variable_is_documented(raw: dict[str, Any]) -> None:
    documented = {
        line.split("=", 1)[0]
        for line in ENV_EXAMPLE.read_text().splitlines()
        if re.match(r"^[A-Z_][A-Z0-9_]*=", line)
    }
    used = compose_vars(raw)
    assert used - documented == set(), "used in docker-compose.yml, missing in .env.example"
    assert documented - used == set(), "documented in .env.example, unused in compose"


def test_env_example_defaults_match_compose(raw: dict[str, Any]) -> None:
    # The value .env.example shows must be the default compose falls back to.
    defaults = {m.group(1): m.group(2) or "" for m in VAR_RE.finditer(COMPOSE.read_text())}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if re.match(r"^[A-Z_][A-Z0-9_]*=", line):
            name, value = line.split("=", 1)
            assert defaults.get(name, "") == value, f"{name}: .env.example says {value!r}"


def test_base_image_default_matches_dockerfile(raw: dict[str, Any]) -> None:
    compose_default = resolve(raw["services"]["hiserve"]["build"]["args"]["BASE_IMAGE"])
    arg = re.search(r"^ARG BASE_IMAGE=(\S+)$", (ROOT / "Dockerfile.musa").read_text(), re.M)
    assert arg is not None and arg.group(1) == compose_default


def test_env_example_points_at_documents_that_exist() -> None:
    text = ENV_EXAMPLE.read_text()
    for doc, heading in re.findall(r'((?:README|docs/[\w-]+)\.md), "([^"]+)"', text):
        body = (ROOT / doc).read_text()
        assert re.search(rf"^#+ {re.escape(heading)}$", body, re.M), (doc, heading)
    for path in re.findall(r"\b((?:docs|docker)/[\w./-]+\.\w+)", text):
        assert (ROOT / path).exists(), f".env.example refers to {path}, which does not exist"
