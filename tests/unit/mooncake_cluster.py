"""A real Mooncake Store on 127.0.0.1 for tests (see bench/mooncake_local.py)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.mooncake_local import Mooncake

__all__ = ["Mooncake", "mooncake_cluster"]


def mooncake_cluster() -> Iterator[Mooncake]:
    """A running cluster for a fixture to yield; stopped when the fixture ends."""
    if shutil.which("mooncake_master", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("mooncake_master is missing: `make setup` installs the mooncake-cpu extra")
    cluster = Mooncake()
    try:
        yield cluster
    finally:
        cluster.stop()
