"""docker/Dockerfile.router (the fleet's router image) passes hadolint with the project
config, like the server images."""

from __future__ import annotations

from pathlib import Path

from tests.container.test_hadolint import run_hadolint

ROOT = Path(__file__).resolve().parents[2]


def test_router_dockerfile_passes_hadolint() -> None:
    done = run_hadolint(ROOT / "docker" / "Dockerfile.router")
    assert done.returncode == 0, f"hadolint findings:\n{done.stdout}{done.stderr}"
