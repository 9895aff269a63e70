"""docker/vendor_torch.py: freezes the image's torch and verifies no later step changed it.

Run as a subprocess against fake site-packages, as the image build runs it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENDOR_TORCH = ROOT / "docker" / "vendor_torch.py"


def run_vendor(*args: str, pythonpath: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run(
        [sys.executable, str(VENDOR_TORCH), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def frozen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vendor") / "constraints.txt"
    done = run_vendor("freeze", str(out), "--require", "torch")
    assert done.returncode == 0, done.stderr
    return out


def test_freeze_pins_the_installed_torch(frozen: Path) -> None:
    lines = [ln for ln in frozen.read_text().splitlines() if not ln.startswith("#")]
    assert f"torch=={importlib.metadata.version('torch')}" in lines
    assert all(re.fullmatch(r"[a-z0-9-]+==\S+", ln) for ln in lines)  # no URLs: pip rejects them


def test_verify_passes_on_an_untouched_environment(frozen: Path) -> None:
    done = run_vendor("verify", str(frozen))
    assert done.returncode == 0, done.stderr


def test_verify_fails_when_torch_changed(tmp_path: Path) -> None:
    constraints = tmp_path / "c.txt"
    constraints.write_text("torch==0.0.1\n")
    done = run_vendor("verify", str(constraints))
    assert done.returncode == 1
    assert "torch was 0.0.1, now " + importlib.metadata.version("torch") in done.stderr
    assert "Traceback" not in done.stderr


def fake_dist(site: Path, name: str, version: str) -> None:
    dist = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_verify_fails_when_nvidia_packages_got_in(frozen: Path, tmp_path: Path) -> None:
    fake_dist(tmp_path, "nvidia-cublas-cu12", "12.4.5.8")
    done = run_vendor("verify", str(frozen), pythonpath=str(tmp_path))
    assert done.returncode == 1
    assert "nvidia-cublas-cu12" in done.stderr


def test_nvidia_packages_the_base_image_shipped_are_not_flagged(tmp_path: Path) -> None:
    """Recorded at freeze time; only one that arrives after the freeze fails the build."""
    base, later = tmp_path / "base", tmp_path / "later"
    fake_dist(base, "nvidia-nccl-cu12", "2.21.5")
    constraints = tmp_path / "c.txt"
    assert run_vendor("freeze", str(constraints), pythonpath=str(base)).returncode == 0
    assert "nvidia-nccl-cu12==2.21.5" in constraints.read_text().splitlines()
    done = run_vendor("verify", str(constraints), pythonpath=str(base))
    assert done.returncode == 0, done.stderr
    fake_dist(later, "nvidia-cublas-cu12", "12.4.5.8")
    done = run_vendor("verify", str(constraints), pythonpath=f"{base}:{later}")
    assert done.returncode == 1
    assert "nvidia-cublas-cu12" in done.stderr and "nvidia-nccl" not in done.stderr


def test_verify_fails_when_torch_musa_is_gone(frozen: Path) -> None:
    done = run_vendor("verify", str(frozen), "--require", "torch_musa")
    assert done.returncode == 1
    assert "torch-musa is not installed" in done.stderr and "Traceback" not in done.stderr


def test_verify_fails_on_a_cuda_torch_without_importing_it(tmp_path: Path) -> None:
    # A torch whose version file says CUDA, and whose import would fail: verify must
    # judge it from the file alone (importing torch at build time autoloads torch_musa).
    version = importlib.metadata.version("torch")
    dist = tmp_path / f"torch-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('imported at build time')\n")
    (tmp_path / "torch" / "version.py").write_text("cuda: Optional[str] = '12.8'\n")
    constraints = tmp_path / "c.txt"
    constraints.write_text(f"torch=={version}\n")
    done = run_vendor("verify", str(constraints), pythonpath=str(tmp_path))
    assert done.returncode == 1
    assert f"torch {version} is a CUDA build (CUDA 12.8)" in done.stderr
    assert "imported at build time" not in done.stderr


def test_vendor_torch_never_imports_torch() -> None:
    source = VENDOR_TORCH.read_text()
    tree = ast.parse(source)
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m.split(".")[0] in ("torch", "torch_musa")}
    assert "import_module" not in source and "__import__" not in source
