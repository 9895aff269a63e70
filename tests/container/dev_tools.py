"""The command-line tools the container tests run (kubectl, hadolint), from their dev
dependencies: the console script next to this Python (the project's venv), else on PATH."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest


def dev_tool(name: str, package: str) -> str:
    """The path of ``name``; the test fails, naming ``package``, where it is missing."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: install the dev extras (`pip install {package}`)")
    return found
