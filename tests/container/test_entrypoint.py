"""docker/entrypoint.py run as a process, the way the container runs it.

This machine has no MUSA GPU and no torch_musa, which is exactly the "wrong image /
no GPU" case. The GPU-present, GPU-hidden, broken-driver and hung-driver cases use a
stand-in ``torch`` + ``torch_musa`` on PYTHONPATH whose behaviour follows
``MUSA_VISIBLE_DEVICES`` the way the real one does (it hides physical GPUs not listed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "docker" / "entrypoint.py"
VALID = ("auto", "cpu", "cuda[:N]", "musa[:N]", "npu[:N]", "xpu[:N]", "mps")

FAKE_TORCH = """
__version__ = "0.0.0+fake"
class version:
    cuda = None
    hip = None
"""
FAKE_TORCH_MUSA = """
import os, time, types
import torch
if os.environ.get("FAKE_MUSA_HANG"):
    time.sleep(120)
if os.environ.get("FAKE_MUSA_IMPORT_ERROR"):
    raise ImportError(os.environ["FAKE_MUSA_IMPORT_ERROR"])
_physical = int(os.environ.get("FAKE_MUSA_GPUS", "0"))
_listed = os.environ.get("MUSA_VISIBLE_DEVICES")
_visible = list(range(_physical)) if _listed is None else [
    int(x) for x in _listed.split(",") if x.strip().isdigit() and int(x) < _physical]
torch.musa = types.SimpleNamespace(
    is_available=lambda: bool(_visible),
    device_count=lambda: len(_visible),
    get_device_name=lambda i: f"FAKE-S4000-physical{_visible[i]}",
)
__version__ = "9.9.9+fake"
"""


@pytest.fixture(scope="module")
def fake_musa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fake_musa")
    (root / "torch").mkdir()
    (root / "torch" / "__init__.py").write_text(FAKE_TORCH)
    (root / "torch_musa").mkdir()
    (root / "torch_musa" / "__init__.py").write_text(FAKE_TORCH_MUSA)
    return root


@pytest.fixture
def empty_mount(tmp_path: Path) -> Path:
    mount = tmp_path / "models"
    mount.mkdir()
    return mount


def base_env(mount: Path, **extra: str) -> dict[str, str]:
    """The caller's environment minus anything that would steer the entrypoint."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HISERVE_", "MUSA_", "CUDA_", "HIP_", "MTHREADS_"))
        and k != "PYTHONPATH"
    }
    env["HISERVE_MODEL_MOUNT"] = str(mount)
    env.update(extra)
    return env


def run_entry(
    env: dict[str, str], *args: str, cwd: Path = ROOT, timeout: float = 60
) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(ENTRYPOINT), *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return done, time.monotonic() - start


# --- the real environment of this machine ------------------------------------------


def test_musa_without_torch_musa_fails_fast_and_clearly(empty_mount: Path) -> None:
    done, _ = run_entry(base_env(empty_mount, HISERVE_DEVICE="musa:0"))
    assert done.returncode == 3  # the no-device code, not just any failure
    assert "torch_musa" in done.stderr and "not installed" in done.stderr
    assert "Dockerfile.musa" in done.stderr  # says which image to use instead
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.parametrize("bad", ["gpu", "musa:x", "cuda:-1", "auto:0", "musa:0:1", "tpu:0"])
def test_bad_device_lists_the_valid_values(empty_mount: Path, bad: str) -> None:
    done, _ = run_entry(base_env(empty_mount, HISERVE_DEVICE=bad))
    assert done.returncode == 2
    assert repr(bad) in done.stderr
    for value in VALID:
        assert value in done.stderr
    assert "Traceback" not in done.stderr


def test_bad_device_on_the_command_line_is_checked_too(empty_mount: Path) -> None:
    done, _ = run_entry(base_env(empty_mount, HISERVE_DEVICE="cpu"), "--device", "gpu")
    assert done.returncode == 2 and "'gpu'" in done.stderr


def test_cuda_on_a_cpu_torch_says_so(empty_mount: Path) -> None:
    done, _ = run_entry(base_env(empty_mount, HISERVE_DEVICE="cuda"))
    assert done.returncode == 3
    assert "CUDA" in done.stderr and "Traceback" not in done.stderr


def test_cpu_preflight_only_passes(empty_mount: Path) -> None:
    done, _ = run_entry(base_env(empty_mount, HISERVE_DEVICE="CPU", HISERVE_PREFLIGHT="only"))
    assert done.returncode == 0, done.stderr
    assert "device: cpu" in done.stderr
    assert "-m server" in done.stderr
    assert "no model under" in done.stderr and "default" in done.stderr


def test_other_commands_run_untouched(empty_mount: Path) -> None:
    # `docker run IMAGE python -c ...` skips the preflight, even with a bad device.
    done, _ = run_entry(
        base_env(empty_mount, HISERVE_DEVICE="gpu"), sys.executable, "-c", "print('plain command')"
    )
    assert done.returncode == 0 and done.stdout.strip() == "plain command"


# --- exec into the server: what the server process receives ------------------------

FAKE_SERVER = """
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "pid": os.getpid(),
                  "env": {k: v for k, v in os.environ.items()
                          if k.startswith(("HISERVE_", "MUSA_"))}}))
"""


def test_execs_the_server_with_cleaned_settings(empty_mount: Path, tmp_path: Path) -> None:
    # A stand-in `server` package in the working directory records what it was given.
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "__main__.py").write_text(FAKE_SERVER)
    env = base_env(
        empty_mount,
        HISERVE_DEVICE="cpu",
        HISERVE_KV_CACHE_TOKENS="",
        HISERVE_HICACHE_SIZE="  ",
        HISERVE_PORT="8123",
    )
    proc = subprocess.Popen(
        [sys.executable, str(ENTRYPOINT), "--log-level", "debug"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    seen = json.loads(out)
    assert seen["pid"] == proc.pid  # exec, not a child: the server gets SIGTERM directly
    assert seen["argv"] == ["--log-level", "debug"]
    assert seen["env"]["HISERVE_DEVICE"] == "cpu"
    assert seen["env"]["HISERVE_MODEL"] == "default"
    assert seen["env"]["HISERVE_PORT"] == "8123"
    # compose passes unset settings as empty strings; the server must not see them
    assert "HISERVE_KV_CACHE_TOKENS" not in seen["env"]
    assert "HISERVE_HICACHE_SIZE" not in seen["env"]


def test_mounted_model_is_picked_up(tmp_path: Path) -> None:
    mount = tmp_path / "models"
    (mount / "qwen").mkdir(parents=True)
    (mount / "qwen" / "config.json").write_text("{}")
    done, _ = run_entry(base_env(mount, HISERVE_DEVICE="cpu", HISERVE_PREFLIGHT="only"))
    assert done.returncode == 0
    assert f"model: {mount / 'qwen'}" in done.stderr
    (mount / "other.gguf").write_bytes(b"GGUF")
    done, _ = run_entry(base_env(mount, HISERVE_DEVICE="cpu", HISERVE_PREFLIGHT="only"))
    assert done.returncode == 2 and "several models" in done.stderr
    done, _ = run_entry(
        base_env(
            mount,
            HISERVE_DEVICE="cpu",
            HISERVE_PREFLIGHT="only",
            HISERVE_MODEL=str(mount / "other.gguf"),
        )
    )
    assert done.returncode == 0 and f"model: {mount / 'other.gguf'}" in done.stderr


def test_missing_model_path_is_reported(empty_mount: Path) -> None:
    done, _ = run_entry(
        base_env(empty_mount, HISERVE_DEVICE="cpu", HISERVE_MODEL=str(empty_mount / "nope"))
    )
    assert done.returncode == 2
    assert "does not exist" in done.stderr and "HISERVE_MODEL_DIR" in done.stderr


# --- MUSA with a stand-in torch_musa ------------------------------------------------


def musa_env(fake: Path, mount: Path, **extra: str) -> dict[str, str]:
    return base_env(mount, PYTHONPATH=str(fake), HISERVE_PREFLIGHT="only", **extra)


def test_musa_index_pins_the_visible_device(fake_musa: Path, empty_mount: Path) -> None:
    done, _ = run_entry(
        musa_env(fake_musa, empty_mount, HISERVE_DEVICE="musa:1", FAKE_MUSA_GPUS="2")
    )
    assert done.returncode == 0, done.stderr
    # GPU 1 became the only visible one, so the server uses musa:0 and sees physical 1
    assert "MUSA_VISIBLE_DEVICES=1" in done.stderr
    assert "FAKE-S4000-physical1" in done.stderr
    assert "HISERVE_DEVICE=musa:0" in done.stderr
    assert "torch_musa=9.9.9+fake" in done.stderr


@pytest.mark.parametrize("how", ["env", "cli"])
def test_tensor_parallel_pins_one_gpu_per_rank(
    fake_musa: Path, empty_mount: Path, how: str
) -> None:
    extra = {"HISERVE_TENSOR_PARALLEL_SIZE": "2"} if how == "env" else {}
    env = musa_env(fake_musa, empty_mount, HISERVE_DEVICE="musa:1", FAKE_MUSA_GPUS="3", **extra)
    done, _ = run_entry(env, *(["--tp", "2"] if how == "cli" else []))
    assert done.returncode == 0, done.stderr
    # GPUs 1 and 2 are visible, as musa:0 and musa:1: rank r runs on musa:r.
    assert "MUSA_VISIBLE_DEVICES=1,2" in done.stderr
    assert "HISERVE_DEVICE=musa:0" in done.stderr


def test_user_visible_devices_are_respected(fake_musa: Path, empty_mount: Path) -> None:
    env = musa_env(
        fake_musa,
        empty_mount,
        HISERVE_DEVICE="musa:1",
        FAKE_MUSA_GPUS="2",
        MUSA_VISIBLE_DEVICES="1",
    )
    done, _ = run_entry(env)
    assert done.returncode == 3
    assert "only 1 musa GPU(s) are visible" in done.stderr
    assert "Traceback" not in done.stderr


def test_musa_not_available_names_driver_and_toolkit(fake_musa: Path, empty_mount: Path) -> None:
    env = musa_env(fake_musa, empty_mount, HISERVE_DEVICE="musa", FAKE_MUSA_GPUS="0")
    env["HISERVE_PREFLIGHT"] = "1"
    done, _ = run_entry(env)
    assert done.returncode == 3
    for hint in (
        "is_available() is False",
        "mthreads",
        "MTHREADS_VISIBLE_DEVICES",
        "MTHREADS_DRIVER_CAPABILITIES=compute,utility",
        "driver",
    ):
        assert hint in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_musa_import_failure_is_explained(fake_musa: Path, empty_mount: Path) -> None:
    error = "libmusa.so.4: cannot open shared object file"
    done, _ = run_entry(
        musa_env(fake_musa, empty_mount, HISERVE_DEVICE="musa:0", FAKE_MUSA_IMPORT_ERROR=error)
    )
    assert done.returncode == 3
    assert error in done.stderr and "driver" in done.stderr
    assert "Traceback" not in done.stderr


def test_hung_driver_times_out(fake_musa: Path, empty_mount: Path) -> None:
    done, _ = run_entry(
        musa_env(
            fake_musa,
            empty_mount,
            HISERVE_DEVICE="musa:0",
            FAKE_MUSA_HANG="1",
            HISERVE_PREFLIGHT_TIMEOUT="1",
        )
    )
    assert done.returncode == 3
    assert "did not finish within 1 s" in done.stderr


def test_auto_picks_musa_when_present(fake_musa: Path, empty_mount: Path) -> None:
    done, _ = run_entry(musa_env(fake_musa, empty_mount, FAKE_MUSA_GPUS="1"))
    assert done.returncode == 0, done.stderr
    assert "device: musa" in done.stderr
    done, _ = run_entry(musa_env(fake_musa, empty_mount, FAKE_MUSA_GPUS="0"))
    assert done.returncode == 0 and "device: cpu" in done.stderr


def test_hicache_settings_in_the_summary(empty_mount: Path) -> None:
    env = base_env(
        empty_mount,
        HISERVE_DEVICE="cpu",
        HISERVE_PREFLIGHT="only",
        HISERVE_ENABLE_HIERARCHICAL_CACHE="1",
        HISERVE_HICACHE_RATIO="3",
        HISERVE_HICACHE_HOST_ALLOC="pin_memory",
    )
    done, _ = run_entry(env)
    assert "hicache: on, ratio=3" in done.stderr and "host_alloc=pin_memory" in done.stderr


# --- the parser agrees with the engine's --------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "auto",
        "cpu",
        "CPU",
        "cpu:0",
        "cuda",
        "cuda:1",
        " Cuda:2 ",
        "hip:0",
        "musa",
        "musa:0",
        "MUSA:3",
        "npu:1",
        "xpu",
        "xpu:0",
        "mps",
        "gpu",
        "musa:",
        "musa:x",
        "cuda:-1",
        "auto:0",
        "",
        ":0",
        "musa:0:1",
    ],
)
def test_device_parsing_matches_engine_platform(text: str) -> None:
    from engine import platform

    sys.path.insert(0, str(ENTRYPOINT.parent))
    try:
        import preflight
    finally:
        sys.path.pop(0)
    try:
        engine_spec = platform.parse_device(text)
        expected: tuple[str, int | None] | None = (engine_spec.type, engine_spec.index)
    except ValueError:
        expected = None
    try:
        ours = preflight.parse_device(text)
        got: tuple[str, int | None] | None = (ours.type, ours.index)
    except preflight.PreflightError:
        got = None
    assert got == expected
