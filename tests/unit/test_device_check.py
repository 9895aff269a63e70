"""The device check's CPU-checkable parts: it refuses to run without CUDA, and its GPU
test modules import and collect where the server-only packages are missing (as on the
GPU machine: no fastapi, pydantic, uvicorn, gguf or openai)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "device_check.py"
BLOCKED = ("fastapi", "pydantic", "uvicorn", "gguf", "openai")


def run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        args, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300, check=False
    )


def test_refuses_at_once_without_cuda() -> None:
    result = run([sys.executable, str(SCRIPT)])
    assert result.returncode == 3, result.stdout + result.stderr
    assert re.search(r"CPU-only build|no CUDA device is visible", result.stderr)
    assert "nothing was tested" in result.stderr
    assert "passed" not in result.stdout  # no test ran


def test_refuses_when_torch_is_missing(tmp_path: Path) -> None:
    """The machine's python3 without torch: a clear message, not a traceback."""
    (tmp_path / "torch.py").write_text("raise ImportError('no torch here')\n")
    result = run([sys.executable, str(SCRIPT)], PYTHONPATH=str(tmp_path))
    assert result.returncode == 3
    assert "torch cannot be imported" in result.stderr and "no torch here" in result.stderr


def test_make_target_uses_the_machines_python_and_no_venv() -> None:
    rule = re.search(r"^device-check:(.*)\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert rule is not None
    prerequisites, recipe = rule.group(1).strip(), rule.group(2)
    assert prerequisites == ""  # not `setup`: no venv, no pip on the GPU machine
    assert recipe == "$(PYTHON) tests/gpu/device_check.py"


BLOCKER = textwrap.dedent(
    """
    import importlib.abc
    import sys

    BLOCKED = {blocked!r}

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    for name in list(sys.modules):
        if name.split(".")[0] in BLOCKED:
            del sys.modules[name]
    sys.meta_path.insert(0, Blocker())

    # What the GPU tests' fixtures import, then the modules themselves via collection.
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: F401

    AutoTokenizer.from_pretrained("tests/gpu/tokenizer", local_files_only=True)
    sys.path.insert(0, {root!r})
    sys.argv[0] = {script!r}
    import runpy

    check = runpy.run_path({script!r})
    import pytest

    args = check["pytest_command"](__import__("pathlib").Path("unused.xml"))[3:]
    args = [a for a in args if not a.startswith("--junitxml")]
    code = pytest.main(["--collect-only", *args])
    loaded = sorted(n for n in sys.modules if n.split(".")[0] in BLOCKED)
    print("LOADED-BLOCKED", loaded)
    sys.exit(code)
    """
)


def test_gpu_tests_collect_without_server_packages() -> None:
    code = BLOCKER.format(blocked=BLOCKED, root=str(ROOT), script=str(SCRIPT))
    result = run([sys.executable, "-c", code])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "LOADED-BLOCKED []" in output
    collected = re.search(r"(\d+) tests collected", output)
    assert collected is not None and int(collected.group(1)) >= 15, output
    for name in (
        "test_bytes_pinned_equal_bytes_asked",
        "test_load_returns_at_once_and_compute_reads_the_loaded_kv[layer_first]",
        "test_bf16_decode_batch_matches_one_by_one",
        "test_failed_register_through_the_engine",
        "test_engine_close_with_backups_in_flight",
        "test_hicache_matches_the_radix_cache[write_back-4-layer_first]",
        "test_decode_speed",
    ):
        assert name in output
    # Only tests/gpu: nothing from the CPU suite.
    assert "tests/unit/" not in output and "tests/integration/" not in output


def test_tokenizer_is_small_and_self_contained() -> None:
    folder = ROOT / "tests" / "gpu" / "tokenizer"
    sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
    assert set(sizes) == {"tokenizer.json", "tokenizer_config.json"}
    assert sum(sizes.values()) < 64 * 1024


SESSION = ROOT / "tests" / "gpu" / "session.sh"


def session_parts() -> list[tuple[str, int, list[str]]]:
    """(name, seconds, command) of each ``part`` line of tests/gpu/session.sh."""
    parts = []
    for line in SESSION.read_text().splitlines():
        if line.startswith("part "):
            _, name, limit, *command = line.split()
            parts.append((name, int(limit), command))
    return parts


def test_the_session_script_fits_one_device_call_and_its_commands_take_their_flags() -> None:
    assert subprocess.run(["bash", "-n", str(SESSION)], check=False).returncode == 0
    parts = session_parts()
    assert parts[0][0] == "device_check"
    # One device call runs 10 minutes at most; the parts and their kill grace fit in 9.5.
    assert sum(limit + 10 for _, limit, _ in parts) <= 570
    for name, _, command in parts:
        assert command[0] == "python3" and (ROOT / command[1]).is_file(), name
        flags = [arg for arg in command[2:] if arg.startswith("--")]
        if not flags:
            continue
        usage = run([sys.executable, command[1], "--help"])
        assert usage.returncode == 0, usage.stderr
        for flag in flags:
            assert flag in usage.stdout, (name, flag)


def test_the_session_script_stops_at_once_without_cuda(tmp_path: Path) -> None:
    # The machine's python3 as the session sees it: this interpreter (CPU torch).
    (tmp_path / "python3").symlink_to(sys.executable)
    result = run(
        ["bash", str(SESSION)],
        OUT=str(tmp_path / "out"),
        PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
    )
    assert result.returncode == 3, result.stdout + result.stderr
    assert "== device_check: exit 3" in result.stdout
    assert "kernel_goals" not in result.stdout  # nothing else spent device time
    assert (tmp_path / "out" / "device_check.log").is_file()


def test_a_kept_folder_holds_the_report_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With HISERVE_DEVICE_CHECK_DIR the JUnit XML and the figures stay there (a session
    cut short keeps them); the session script sets it."""
    from tests.gpu import device_check

    def pytest_run(command: list[str], cwd: Path, env: dict[str, str]) -> int:
        junit = Path(next(a for a in command if a.startswith("--junitxml=")).split("=", 1)[1])
        junit.write_text('<testsuite><testcase name="t" time="1.0"/></testsuite>')
        Path(env["HISERVE_DEVICE_REPORT"]).write_text('{"name": "f", "value": 1, "unit": ""}\n')
        return 0

    kept = tmp_path / "kept"
    monkeypatch.setenv(device_check.KEEP_ENV, str(kept))
    monkeypatch.setattr(device_check, "cuda_problem", lambda: None)
    monkeypatch.setattr(device_check.subprocess, "call", pytest_run)
    monkeypatch.setattr(device_check, "report", lambda rows, figures, seconds: str(rows))
    assert device_check.main() == 0
    assert (kept / "junit.xml").is_file() and (kept / "figures.jsonl").is_file()
    assert f'export {device_check.KEEP_ENV}="$OUT/device_check"' in SESSION.read_text()
