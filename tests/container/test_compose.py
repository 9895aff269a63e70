"""docker-compose.yml has the structure a MUSA host needs (no Docker engine here).

Values are checked after resolving ``${VAR:-default}`` to the defaults, i.e. what
`docker compose up` uses without a .env file. Flag names and choices are checked
against the server's own argument table and the engine's config, not against copies.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.__main__ import build_parser as bench_parser
from engine.config import HICACHE_HOST_ALLOC, HICACHE_MEM_LAYOUTS, HICACHE_WRITE_POLICIES
from server.args import FLAG_TABLE, parse_args

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
SERVERS = ("hiserve", "hiserve-cpu")
# Read by docker/entrypoint.py, not by the server.
ENTRYPOINT_VARS = {"HISERVE_PREFLIGHT", "HISERVE_PREFLIGHT_TIMEOUT", "HISERVE_MODEL_MOUNT"}
VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def resolve(value: Any) -> Any:
    """Interpolate like compose with no variables set: ${X:-d} -> d, ${X} -> ''."""
    if isinstance(value, str):
        return VAR_RE.sub(lambda m: m.group(2) or "", value).replace("$$", "$")
    if isinstance(value, list):
        return [resolve(v) for v in value]
    if isinstance(value, dict):
        return {k: resolve(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(raw: dict[str, Any]) -> dict[str, Any]:
    return resolve(raw["services"])


def compose_vars(raw: Any) -> set[str]:
    """Every variable the compose file interpolates (in values, not comments)."""
    if isinstance(raw, str):
        return {m.group(1) for m in VAR_RE.finditer(raw)}
    if isinstance(raw, list):
        return set().union(*map(compose_vars, raw)) if raw else set()
    if isinstance(raw, dict):
        return set().union(*map(compose_vars, raw.values())) if raw else set()
    return set()


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
    readme = (ROOT / "README.md").read_text()
    for heading in re.findall(r'README\.md, "([^"]+)"', text):
        assert re.search(rf"^#+ {re.escape(heading)}$", readme, re.M), heading
    for path in re.findall(r"\b((?:docs|docker)/[\w./-]+\.\w+)", text):
        assert (ROOT / path).exists(), f".env.example refers to {path}, which does not exist"


# --- Fleet: replicas behind the SGLang Model Gateway (profiles fleet / fleet-cpu) --------
FLEETS = {
    # profile: (router service, replica services)
    "fleet": ("fleet-router", ("fleet-0", "fleet-1")),
    "fleet-cpu": ("fleet-router-cpu", ("fleet-cpu-0", "fleet-cpu-1")),
}
ROUTER_PORT = "30000"


def router_argv(svc: dict[str, Any], api_key: str) -> list[str]:
    """The router's command line as its shell would build it, with HISERVE_API_KEY set to
    ``api_key`` (compose defaults for everything else)."""
    assert svc["entrypoint"] == ["/bin/sh", "-c"]
    (script,) = svc["command"]
    env = {**svc["environment"], "ROUTER_API_KEY": api_key}
    script = re.sub(
        r"\$\{ROUTER_API_KEY:\+([^}]*)\}", lambda m: m.group(1) if api_key else "", script
    )
    script = re.sub(r"\$([A-Z_]+)", lambda m: env[m.group(1)], script)
    argv = shlex.split(script)
    assert argv[:3] == ["exec", "smg", "launch"], argv[:3]
    return argv[3:]


def parse_router(argv: list[str]) -> Any:
    """The real smg 1.13.0 command-line parser: an unknown or misspelled flag fails."""
    from smg.launch_router import parse_router_args

    return parse_router_args(argv)


@pytest.mark.parametrize("profile", FLEETS)
def test_fleet_profile_has_a_router_and_its_replicas(
    services: dict[str, Any], profile: str
) -> None:
    router, replicas = FLEETS[profile]
    in_profile = {name for name, svc in services.items() if profile in svc.get("profiles", [])}
    assert in_profile == {router, *replicas}
    # the router starts after every replica is healthy
    assert services[router]["depends_on"] == {
        name: {"condition": "service_healthy"} for name in replicas
    }
    # one published port for the whole fleet: the router's
    for name in replicas:
        assert "ports" not in services[name], f"{name} must not publish a port"
    (published,) = services[router]["ports"]
    assert str(published).endswith(f":{ROUTER_PORT}")


@pytest.mark.parametrize("profile", FLEETS)
def test_fleet_replicas_are_servers(services: dict[str, Any], profile: str) -> None:
    _, replicas = FLEETS[profile]
    caches = set()
    for name in replicas:
        svc = services[name]
        env = svc["environment"]
        assert env["HISERVE_HOST"] == "0.0.0.0" and env["HISERVE_PORT"] == "8000"
        assert {k for k in env if k.startswith("HISERVE_")} - {
            spec.env for spec in FLAG_TABLE
        } - ENTRYPOINT_VARS == set()
        assert svc["healthcheck"]["test"][:2] == ["CMD", "python"]
        assert "/opt/hiserve/healthcheck.py" in svc["healthcheck"]["test"]
        assert int(svc["healthcheck"]["start_period"].rstrip("s")) >= 300
        mounts = {v.split(":")[1]: v for v in svc["volumes"]}
        assert mounts["/models"].endswith(":ro")
        caches.add(mounts["/var/cache/hiserve"].split(":")[0])
    assert len(caches) == len(replicas), "each replica converts models into its own cache"
    assert caches <= set(yaml.safe_load(COMPOSE.read_text())["volumes"])


def test_musa_fleet_puts_each_replica_on_its_own_gpu(services: dict[str, Any]) -> None:
    _, replicas = FLEETS["fleet"]
    gpus = []
    for name in replicas:
        svc = services[name]
        env = svc["environment"]
        assert svc["runtime"] == "mthreads" and svc["ipc"] == "host"
        assert svc["build"]["dockerfile"] == "Dockerfile.musa"
        assert env["MTHREADS_DRIVER_CAPABILITIES"] == "compute,utility"
        # one GPU visible, which the process then sees as musa:0
        assert re.fullmatch(r"\d+", env["MTHREADS_VISIBLE_DEVICES"]), name
        assert env["HISERVE_DEVICE"] == "musa:0"
        gpus.append(env["MTHREADS_VISIBLE_DEVICES"])
    assert len(set(gpus)) == len(gpus), f"replicas share a GPU: {gpus}"
    for name in FLEETS["fleet-cpu"][1]:
        svc = services[name]
        assert "runtime" not in svc and svc["environment"]["HISERVE_DEVICE"] == "cpu"
        assert not any(k.startswith("MTHREADS_") for k in svc["environment"])


@pytest.mark.parametrize("profile", FLEETS)
def test_router_command_is_valid_for_smg(services: dict[str, Any], profile: str) -> None:
    router, replicas = FLEETS[profile]
    svc = services[router]
    args = parse_router(router_argv(svc, api_key="sk-test"))
    ports = {name: services[name]["environment"]["HISERVE_PORT"] for name in replicas}
    assert args.worker_urls == [f"http://{name}:{port}" for name, port in ports.items()]
    assert args.policy == "cache_aware"
    assert (args.host, str(args.port)) == ("0.0.0.0", ROUTER_PORT)
    assert args.api_key == "sk-test"  # the same key the replicas get
    assert services[replicas[0]]["environment"]["HISERVE_API_KEY"] == ""  # from the same var
    assert args.disable_retries is True
    assert 0 < args.cache_threshold <= 1 and args.balance_rel_threshold >= 1
    # smg refuses an empty key: without HISERVE_API_KEY the flag is left out entirely
    assert parse_router(router_argv(svc, api_key="")).api_key is None
    check = " ".join(svc["healthcheck"]["test"])
    assert f"127.0.0.1:{ROUTER_PORT}/readiness" in check


def test_router_command_check_catches_a_misspelled_flag(services: dict[str, Any]) -> None:
    argv = router_argv(services["fleet-router"], api_key="k")
    broken = ["--polcy" if a == "--policy" else a for a in argv]
    with pytest.raises(SystemExit):
        parse_router(broken)


def test_router_image_pins_the_tested_smg(services: dict[str, Any]) -> None:
    pin = re.search(r'"smg==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin is not None
    dockerfile = (ROOT / "docker" / "Dockerfile.router").read_text()
    assert re.search(rf"^ARG SMG_VERSION={re.escape(pin.group(1))}$", dockerfile, re.M)
    for router, _ in FLEETS.values():
        svc = services[router]
        assert svc["build"]["dockerfile"] == "docker/Dockerfile.router"
        assert svc["image"].endswith(f":{pin.group(1)}")


# --- L3: the shared file-backend volume and the Mooncake services -----------------------
def _gflags(binary: str) -> set[str]:
    """Flag names a Mooncake binary accepts, from its own --help."""
    path = Path(sys.executable).parent / binary
    done = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=60)
    return set(re.findall(r"^\s+-(\w+) \(", done.stdout + done.stderr, re.M))


def test_every_server_shares_the_l3_volume(services: dict[str, Any]) -> None:
    servers = [n for n, svc in services.items() if "HISERVE_MODEL" in svc.get("environment", {})]
    assert len(servers) >= 6, servers  # hiserve, hiserve-cpu and four fleet replicas
    for name in servers:
        svc = services[name]
        where = svc["environment"]["HISERVE_HICACHE_STORAGE_DIR"]
        assert f"hicache-l3:{where}" in svc["volumes"], name


@pytest.mark.parametrize("name", ["mooncake-master", "mooncake-holder"])
def test_mooncake_services_use_flags_their_binaries_know(
    services: dict[str, Any], name: str
) -> None:
    binary, *args = services[name]["command"]
    known = _gflags(binary)
    assert known, f"{binary} --help listed no flags"
    for arg in args:
        flag = arg.lstrip("-").split("=", 1)[0]
        assert flag in known, f"{name}: {binary} has no flag --{flag}"
    # The servers are pointed at what these services listen on.
    env = services["hiserve"]["environment"]
    master_port = env["HISERVE_HICACHE_MOONCAKE_MASTER"].rpartition(":")[2]
    metadata_port = env["HISERVE_HICACHE_MOONCAKE_METADATA_SERVER"].split(":")[2].split("/")[0]
    master_args = services["mooncake-master"]["command"]
    assert f"--rpc_port={master_port}" in master_args
    assert f"--http_metadata_server_port={metadata_port}" in master_args


def test_a_replica_can_take_several_gpus_with_tp(raw: dict[str, Any]) -> None:
    # What an operator's .env does for a model split over two GPUs per replica.
    chosen = {
        "HISERVE_TENSOR_PARALLEL_SIZE": "2",
        "MTHREADS_VISIBLE_DEVICES": "0,1",
        "HISERVE_FLEET_GPU_0": "0,1",
        "HISERVE_FLEET_GPU_1": "2,3",
    }

    def interpolate(value: Any) -> Any:
        if isinstance(value, str):
            return VAR_RE.sub(lambda m: chosen.get(m.group(1), m.group(2) or ""), value)
        if isinstance(value, dict):
            return {k: interpolate(v) for k, v in value.items()}
        if isinstance(value, list):
            return [interpolate(v) for v in value]
        return value

    services = interpolate(raw["services"])
    for name in ("hiserve", *FLEETS["fleet"][1]):
        env = {k: str(v) for k, v in services[name]["environment"].items()}
        engine = parse_args([], environ=env).engine  # the server's own flag parsing
        gpus = env["MTHREADS_VISIBLE_DEVICES"].split(",")
        assert engine.tensor_parallel_size == len(gpus) == 2, name
        assert engine.device == "musa:0"  # ranks on musa:0 and musa:1 of the visible GPUs
