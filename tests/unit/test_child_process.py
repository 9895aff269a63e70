"""engine/child_process.py: a module run as a plain child's ``__main__``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from engine.child_process import module_command


def test_the_module_runs_as_main_with_the_arguments(tmp_path: Path) -> None:
    data = tmp_path / "in.json"
    data.write_text('{"b": 1, "a": [2, 3]}')
    done = subprocess.run(
        module_command("json.tool", "--sort-keys", "--compact", str(data)),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == json.dumps({"a": [2, 3], "b": 1}, separators=(",", ":"))
