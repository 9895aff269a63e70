"""docker-compose.yml as the container tests read it: compose's variable interpolation,
and the fleet router's settings as its launcher builds them.

Values are resolved to their ``${VAR:-default}`` defaults, i.e. what `docker compose up`
uses without a .env file.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
SERVERS = ("hiserve", "hiserve-cpu")
# Read by docker/entrypoint.py, not by the server.
ENTRYPOINT_VARS = {"HISERVE_PREFLIGHT", "HISERVE_PREFLIGHT_TIMEOUT", "HISERVE_MODEL_MOUNT"}
VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")
# Fleet: replicas behind the SGLang Model Gateway (profiles fleet / fleet-cpu).
FLEETS = {
    # profile: (router service, replica services)
    "fleet": ("fleet-router", ("fleet-0", "fleet-1")),
    "fleet-cpu": ("fleet-router-cpu", ("fleet-cpu-0", "fleet-cpu-1")),
}
ROUTER_PORT = "30000"


def load_compose() -> dict[str, Any]:
    """docker-compose.yml as written, variables not yet interpolated."""
    compose: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return compose


def resolve(value: Any) -> Any:
    """Interpolate like compose with no variables set: ${X:-d} -> d, ${X} -> ''."""
    if isinstance(value, str):
        return VAR_RE.sub(lambda m: m.group(2) or "", value).replace("$$", "$")
    if isinstance(value, list):
        return [resolve(v) for v in value]
    if isinstance(value, dict):
        return {k: resolve(v) for k, v in value.items()}
    return value


def compose_vars(raw: Any) -> set[str]:
    """Every variable the compose file interpolates (in values, not comments)."""
    if isinstance(raw, str):
        return {m.group(1) for m in VAR_RE.finditer(raw)}
    if isinstance(raw, list):
        return set().union(*map(compose_vars, raw)) if raw else set()
    if isinstance(raw, dict):
        return set().union(*map(compose_vars, raw.values())) if raw else set()
    return set()


def router_args(svc: dict[str, Any], api_key: str, admin_key: str = "") -> Any:
    """smg's parsed settings of a router service, as the image's launcher builds them
    (docker/router_launch.py, with smg's own parser) from the service's command and
    environment, HISERVE_API_KEY set to ``api_key`` and HISERVE_ADMIN_KEY to
    ``admin_key`` (compose defaults for everything else)."""
    assert "entrypoint" not in svc, "the image's launcher is the entrypoint"
    env = {k: str(v) for k, v in svc["environment"].items()}
    env.update(ROUTER_API_KEY=api_key, ROUTER_ADMIN_KEY=admin_key)
    parsed, _ = router_launch().parse([str(a) for a in svc["command"]], env)
    return parsed


def router_launch() -> Any:
    """docker/router_launch.py as a module."""
    sys.path.insert(0, str(ROOT / "docker"))
    try:
        import router_launch
    finally:
        sys.path.pop(0)
    return router_launch


def parse_router(argv: list[str]) -> Any:
    """The real smg 1.13.0 command-line parser: an unknown or misspelled flag fails."""
    from smg.launch_router import parse_router_args

    return parse_router_args(argv)


def binary_flags(binary: str) -> set[str]:
    """Flag names a Mooncake binary accepts, from its own --help."""
    path = Path(sys.executable).parent / binary
    done = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=60)
    return set(re.findall(r"^\s+-(\w+) \(", done.stdout + done.stderr, re.M))
