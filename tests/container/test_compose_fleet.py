"""docker-compose.yml's fleet profiles (replicas behind the SGLang Model Gateway), the
shared L3 volume and Mooncake services, and replicas spanning several GPUs.

Values are checked after resolving ``${VAR:-default}`` to the defaults; the router's
command line is checked with smg's own parser, Mooncake's flags with its binaries' --help.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from server.args import FLAG_TABLE, parse_args
from tests.container.compose_file import (
    ENTRYPOINT_VARS,
    FLEETS,
    ROOT,
    ROUTER_PORT,
    VAR_RE,
    binary_flags,
    load_compose,
    router_args,
    router_launch,
)


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
    assert caches <= set(load_compose()["volumes"])


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
    args = router_args(svc, api_key="sk-test")
    ports = {name: services[name]["environment"]["HISERVE_PORT"] for name in replicas}
    assert args.worker_urls == [f"http://{name}:{port}" for name, port in ports.items()]
    assert args.policy == "cache_aware"
    assert (args.host, str(args.port)) == ("0.0.0.0", ROUTER_PORT)
    assert args.api_key == "sk-test"  # the same key the replicas get
    assert services[replicas[0]]["environment"]["HISERVE_API_KEY"] == ""  # from the same var
    assert 0 < args.cache_threshold <= 1 and args.balance_rel_threshold >= 1
    # smg refuses an empty key: without HISERVE_API_KEY the flag is left out entirely
    assert router_args(svc, api_key="").api_key is None
    # With an admin key (issue 25 item 4): the replicas and the control plane get it, the
    # clients' key opens only the serving routes.
    split = router_args(svc, api_key="sk-client", admin_key="sk admin")
    assert split.api_key == "sk admin"
    assert [tuple(k) for k in split.tenant_api_keys] == [("clients", "sk-client")]
    assert [k[2:] for k in map(tuple, split.control_plane_api_keys)] == [("sk admin", "admin")]
    assert services[replicas[0]]["environment"]["HISERVE_ADMIN_KEY"] == ""  # the same var
    check = " ".join(svc["healthcheck"]["test"])
    assert f"127.0.0.1:{ROUTER_PORT}/readiness" in check


@pytest.mark.parametrize("profile", FLEETS)
def test_router_keys_stay_off_its_command_line(raw: dict[str, Any], profile: str) -> None:
    """Issue 25 item 10: the keys reach smg through the launcher, never through argv."""
    router, _ = FLEETS[profile]
    svc = raw["services"][router]
    written = " ".join(str(a) for a in svc["command"])
    assert "KEY" not in written and "--api-key" not in written
    assert set(svc["environment"]) >= {"ROUTER_API_KEY", "ROUTER_ADMIN_KEY"}


def test_router_command_check_catches_a_misspelled_flag(services: dict[str, Any]) -> None:
    svc = dict(services["fleet-router"])
    svc["command"] = ["--polcy" if a == "--policy" else a for a in svc["command"]]
    with pytest.raises(SystemExit):
        router_args(svc, api_key="k")
    # a key flag on the command line is refused by the launcher itself
    svc["command"] = [*services["fleet-router"]["command"], "--api-key", "leaked"]
    with pytest.raises(router_launch().LaunchError):
        router_args(svc, api_key="k")


@pytest.mark.parametrize("profile", FLEETS)
def test_router_survives_a_replica_death(services: dict[str, Any], profile: str) -> None:
    """The settings docs/fleet.md measured: no request sent after a replica's death
    fails, and a restarted replica is tried again within seconds."""
    args = router_args(services[FLEETS[profile][0]], api_key="k")
    assert args.disable_retries is False
    # A request whose replica refuses the connection is retried; under affinity the
    # same dead replica may be chosen again until its breaker opens, so there must be
    # a try left after the breaker's threshold.
    assert args.retry_max_retries > args.cb_failure_threshold >= 1
    backoffs = [
        min(
            args.retry_initial_backoff_ms * args.retry_backoff_multiplier**i,
            args.retry_max_backoff_ms,
        )
        for i in range(args.retry_max_retries - 1)
    ]
    assert sum(backoffs) * (1 + args.retry_jitter_factor) < 1000, backoffs  # ms
    assert args.cb_timeout_duration_secs <= 10  # a restarted replica is tried again soon
    assert args.cb_success_threshold == 1
    # without traffic, the health check alone takes a dead replica out within ~5 s
    assert args.health_check_interval_secs * args.health_failure_threshold <= 5
    assert args.health_check_timeout_secs <= args.health_check_interval_secs * 2
    assert args.health_success_threshold == 1


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
    known = binary_flags(binary)
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


def test_the_fault_test_runs_what_compose_ships(services: dict[str, Any]) -> None:
    """tests/integration/test_fleet_faults.py starts smg with bench.fleet's
    SHIPPED_BALANCE_FLAGS and SHIPPED_FAULT_FLAGS: they must be the compose router's own
    values."""
    from bench.fleet import SHIPPED_BALANCE_FLAGS, SHIPPED_FAULT_FLAGS
    from tests.container.compose_file import parse_router

    flags = (*SHIPPED_BALANCE_FLAGS, *SHIPPED_FAULT_FLAGS)
    tested = parse_router(["--worker-urls", "http://x:8000", *flags])
    shipped = router_args(services["fleet-router"], api_key="k")
    names = {flag.lstrip("-").replace("-", "_") for flag in flags[::2]}
    assert len(names) == len(flags) // 2
    for name in names:
        assert getattr(tested, name) == getattr(shipped, name), name
