"""The entrypoint's and preflight's less common branches, each with the message it owes.

Process-level cases run docker/entrypoint.py like the container does, with stand-in
``torch`` / ``torch_musa`` packages on PYTHONPATH where a backend must misbehave; the
device-node and pairing checks call preflight's functions directly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.container.test_entrypoint import ENTRYPOINT, base_env, run_entry

sys.path.insert(0, str(ENTRYPOINT.parent))
try:
    import entrypoint
    import preflight
finally:
    sys.path.pop(0)

FAKE_SERVER = """
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "env": {k: v for k, v in os.environ.items()
                  if k.startswith(("HISERVE_", "MUSA_", "CUDA_", "HIP_"))}}))
"""


@pytest.fixture
def mount(tmp_path: Path) -> Path:
    path = tmp_path / "models"
    path.mkdir()
    return path


def stand_ins(root: Path, torch: str, torch_musa: str | None = None) -> str:
    """Write stand-in torch (and torch_musa) packages under ``root``; return the path."""
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text(torch)
    if torch_musa is not None:
        (root / "torch_musa").mkdir()
        (root / "torch_musa" / "__init__.py").write_text(torch_musa)
    return str(root)


def serve(tmp_path: Path, env: dict[str, str], *args: str) -> tuple[int, dict, str]:
    """Run the entrypoint into a stand-in server; return (exit code, what it saw, stderr)."""
    (tmp_path / "server").mkdir(exist_ok=True)
    (tmp_path / "server" / "__main__.py").write_text(FAKE_SERVER)
    done, _ = run_entry(env, *args, cwd=tmp_path)
    seen = json.loads(done.stdout) if done.returncode == 0 and done.stdout.strip() else {}
    return done.returncode, seen, done.stderr


# --- settings ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected", "var", "index"),
    [
        (["--device", "cuda:1"], ["--device", "cuda:0"], "CUDA_VISIBLE_DEVICES", "1"),
        (
            ["--device=hip:2", "--port", "9"],
            ["--device=hip:0", "--port", "9"],
            "HIP_VISIBLE_DEVICES",
            "2",
        ),
    ],
)
def test_a_device_on_the_command_line_is_pinned_and_rewritten(
    tmp_path: Path, mount: Path, args: list[str], expected: list[str], var: str, index: str
) -> None:
    # HISERVE_DEVICE says cpu; the command line wins and is rewritten in place.
    env = base_env(mount, HISERVE_DEVICE="cpu", HISERVE_PREFLIGHT="0")
    code, seen, err = serve(tmp_path, env, *args)
    assert code == 0, err
    assert seen["argv"] == expected
    assert seen["env"][var] == index
    pinned = expected[0].partition("=")[2] or expected[1]
    assert seen["env"]["HISERVE_DEVICE"] == pinned


def test_cuda_and_hip_indices_pin_their_own_visible_devices(tmp_path: Path, mount: Path) -> None:
    for device, var, index in (
        ("cuda:1", "CUDA_VISIBLE_DEVICES", "1"),
        ("HIP:2", "HIP_VISIBLE_DEVICES", "2"),
    ):
        env = base_env(mount, HISERVE_DEVICE=device, HISERVE_PREFLIGHT="0")
        code, seen, err = serve(tmp_path, env)
        assert code == 0, err
        assert seen["env"][var] == index
        assert seen["env"]["HISERVE_DEVICE"] == device.lower().split(":")[0] + ":0"


def test_preflight_off_skips_the_device_check(tmp_path: Path, mount: Path) -> None:
    # musa without torch_musa fails the check (exit 3); with the check off it is not run.
    env = base_env(mount, HISERVE_DEVICE="musa:0", HISERVE_PREFLIGHT="0")
    code, seen, err = serve(tmp_path, env)
    assert code == 0, err
    assert seen["env"]["HISERVE_DEVICE"] == "musa:0" and seen["env"]["MUSA_VISIBLE_DEVICES"] == "0"
    env["HISERVE_PREFLIGHT"] = "1"
    assert serve(tmp_path, env)[0] == 3


@pytest.mark.parametrize(
    ("name", "value"), [("HISERVE_PREFLIGHT", "maybe"), ("HISERVE_PREFLIGHT_TIMEOUT", "soon")]
)
def test_invalid_preflight_settings_are_bad_configuration(
    mount: Path, name: str, value: str
) -> None:
    done, _ = run_entry(base_env(mount, HISERVE_DEVICE="cpu", **{name: value}))
    assert done.returncode == preflight.EXIT_BAD_CONFIG
    assert name in done.stderr and "Traceback" not in done.stderr


def test_a_command_that_cannot_run_exits_127(mount: Path) -> None:
    done, _ = run_entry(base_env(mount), "no-such-command-hiserve")
    assert done.returncode == 127
    assert "cannot run 'no-such-command-hiserve'" in done.stderr


def test_a_gguf_in_a_sub_folder_is_found(mount: Path) -> None:
    (mount / "smol").mkdir()
    (mount / "smol" / "model-q8.gguf").write_bytes(b"GGUF")
    assert entrypoint.find_models(mount) == [mount / "smol" / "model-q8.gguf"]
    done, _ = run_entry(base_env(mount, HISERVE_DEVICE="cpu", HISERVE_PREFLIGHT="only"))
    assert done.returncode == 0 and f"model: {mount / 'smol' / 'model-q8.gguf'}" in done.stderr


# --- probe failures ------------------------------------------------------------------


def test_a_probe_that_crashes_without_a_report(tmp_path: Path, mount: Path) -> None:
    path = stand_ins(tmp_path / "fake", "import os\nos.abort()\n")
    done, _ = run_entry(base_env(mount, HISERVE_DEVICE="cuda", PYTHONPATH=path))
    assert done.returncode == preflight.EXIT_NO_DEVICE
    assert "the device check crashed (exit code -6)" in done.stderr


def test_torch_that_fails_to_import_means_a_broken_image(tmp_path: Path, mount: Path) -> None:
    path = stand_ins(tmp_path / "fake", "raise ImportError('libtorch_cpu.so: bad ELF')\n")
    done, _ = run_entry(base_env(mount, HISERVE_DEVICE="cuda", PYTHONPATH=path))
    assert done.returncode == preflight.EXIT_NO_DEVICE
    assert "torch failed to import (ImportError: libtorch_cpu.so: bad ELF)" in done.stderr
    assert "the image is broken" in done.stderr


def test_musa_failing_while_counting_gpus(tmp_path: Path, mount: Path) -> None:
    musa = (
        "import types, torch\n"
        "def _fail():\n    raise RuntimeError('MUSA error: invalid device ordinal')\n"
        "torch.musa = types.SimpleNamespace(is_available=_fail, device_count=_fail)\n"
    )
    path = stand_ins(tmp_path / "fake", "__version__ = '0+fake'\n", musa)
    done, _ = run_entry(base_env(mount, HISERVE_DEVICE="musa", PYTHONPATH=path))
    assert done.returncode == preflight.EXIT_NO_DEVICE
    assert "torch.musa failed while counting GPUs" in done.stderr
    assert "invalid device ordinal" in done.stderr and "device nodes" in done.stderr


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("npu:0", "needs torch_npu, which is not installed in this image"),
        ("xpu", "torch.xpu reports no available device"),
        ("mps", "torch.mps reports no available device"),
    ],
)
def test_other_backends_say_what_is_missing(mount: Path, device: str, message: str) -> None:
    done, _ = run_entry(base_env(mount, HISERVE_DEVICE=device), timeout=120)
    assert done.returncode == preflight.EXIT_NO_DEVICE
    assert message in done.stderr and "Traceback" not in done.stderr


# --- device nodes and GPU pairing ------------------------------------------------------


def test_device_nodes_missing_accessible_and_blocked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pattern = str(tmp_path / "mtgpu*")
    assert "no /dev/mtgpu*" in preflight._device_nodes([pattern])
    node = tmp_path / "mtgpu0"
    node.write_text("")
    assert preflight._device_nodes([pattern]) == f"device nodes present and accessible: {node}"
    # Root can open anything, so the check itself is what is faked here.
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    message = preflight._device_nodes([pattern])
    gid = node.stat().st_gid
    assert f"not accessible to uid {os.getuid()}" in message and str(node) in message
    assert f"HISERVE_DEVICE_GROUP={gid}" in message and "HISERVE_USER=root" in message


@pytest.mark.parametrize(
    ("device", "listed", "warns"),
    [
        ("musa:1", "1", True),
        ("musa:1", "0,1", False),
        ("musa:2", "0, 1", True),
        ("musa:1", "all", False),
        ("musa", "1", False),
        ("cuda:1", "1", False),
    ],
)
def test_visible_devices_pairing(device: str, listed: str, warns: bool) -> None:
    spec = preflight.parse_device(device)
    warning = preflight.visible_devices_warning(spec, {"MTHREADS_VISIBLE_DEVICES": listed})
    assert (warning is not None) == warns
    if warning:
        assert "HISERVE_DEVICE=musa:0" in warning and f"musa:{spec.index}" in warning


def test_the_pairing_warning_reaches_the_log(mount: Path) -> None:
    env = base_env(mount, HISERVE_DEVICE="musa:1", MTHREADS_VISIBLE_DEVICES="1")
    done = subprocess.run(
        [sys.executable, str(ENTRYPOINT)], env=env, capture_output=True, text=True, timeout=60
    )
    assert "warning: MTHREADS_VISIBLE_DEVICES=1 passes 1 GPU(s)" in done.stderr
