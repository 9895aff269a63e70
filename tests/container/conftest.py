"""Fixtures shared by the container tests: docker-compose.yml, raw and resolved."""

from __future__ import annotations

from typing import Any

import pytest

from tests.container.compose_file import load_compose, resolve


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    """docker-compose.yml as written (``${VAR:-default}`` left in place)."""
    return load_compose()


@pytest.fixture(scope="module")
def services(raw: dict[str, Any]) -> dict[str, Any]:
    """The services with every variable resolved to its compose default."""
    resolved: dict[str, Any] = resolve(raw["services"])
    return resolved
