"""The shipped defaults keep the API on loopback: compose publishes 127.0.0.1 unless the
operator opts in, and .env.example says the same (checked statically; no Docker here)."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def _resolve(text: str, env: dict[str, str]) -> str:
    """Compose interpolation: ``${X:-d}`` -> env X when set and non-empty, else d."""
    return VAR_RE.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), text)


def _published(mapping: str) -> tuple[str | None, str, str]:
    """Short port syntax ``[HOST_IP:]HOST_PORT:CONTAINER_PORT`` -> (ip, host, container)."""
    parts = mapping.rsplit(":", 2)
    if len(parts) == 3:
        return parts[0].strip("[]"), parts[1], parts[2]
    return None, parts[0], parts[1]


def _env_example() -> dict[str, str]:
    values = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line and not line.startswith("#") and "=" in line:
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values


def _port_mappings() -> list[str]:
    services: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    found = [str(p) for svc in services.values() for p in svc.get("ports", [])]
    assert found, "no published ports found"
    return found


@pytest.mark.parametrize("env", [{}, "example"], ids=["no .env", ".env copied from .env.example"])
def test_ports_are_published_on_loopback_by_default(env: Any) -> None:
    values = _env_example() if env == "example" else {}
    for mapping in _port_mappings():
        ip, _, _ = _published(_resolve(mapping, values))
        assert ip is not None, f"{mapping} publishes on every interface"
        assert ipaddress.ip_address(ip).is_loopback, mapping


def test_operator_can_opt_in_to_every_interface() -> None:
    for mapping in _port_mappings():
        # Each published port has its own setting (the API, the fleet's router).
        match = VAR_RE.search(mapping)
        assert match is not None, f"{mapping} cannot be changed from .env"
        port = mapping.rsplit(":", 1)[1]
        ip, host_port, container_port = _published(_resolve(mapping, {match.group(1): port}))
        assert ip is None and host_port == container_port == port
