"""What Dockerfile.musa sets up for the libraries it carries: tvm_ffi told not to compile a
torch extension in every new container, and the Mooncake client's system libraries and
build argument wired from compose to the install step."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.container.build_rehearsal import _env_pairs, instructions

ROOT = Path(__file__).resolve().parents[2]
MUSA = ROOT / "Dockerfile.musa"
# Each library the mooncake-transfer-engine-musa wheel's store.so links that a torch_musa
# base image lacks, and the Ubuntu package that provides it.
MOONCAKE_LIBRARIES = {
    "libibverbs.so.1": "libibverbs1",
    "libmlx5.so.1": "ibverbs-providers",
    "libnuma.so.1": "libnuma1",
    "libcurl.so.4": "libcurl4",
}
# A vendor torch without the DLPack exchange API (older than PyTorch's), and a record of
# every subprocess tvm_ffi starts at import (its JIT build of the torch extension).
TVM_PROBE = """
import json, subprocess, sys, warnings
import torch
if hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
    delattr(torch.Tensor, "__dlpack_c_exchange_api__")
started = []
def record(args, *rest, **kwargs):
    started.append([str(a) for a in args])
    raise OSError("no compiler in this test")
subprocess.run = record
warnings.simplefilter("ignore")
import xgrammar
print(json.dumps(started))
"""


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, args in instructions(MUSA.read_text()):
        if keyword == "ENV":
            env.update(_env_pairs(args))
    return env


def builds_at_import(env: dict[str, str], cache: Path) -> list[list[str]]:
    done = subprocess.run(
        [sys.executable, "-c", TVM_PROBE],
        capture_output=True,
        text=True,
        env={**os.environ, **env, "TVM_FFI_CACHE_DIR": str(cache)},
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_image_keeps_tvm_ffi_from_compiling_at_import(tmp_path: Path) -> None:
    env = {k: v for k, v in image_env().items() if k.startswith("TVM_FFI_")}
    assert env, "Dockerfile.musa sets no TVM_FFI_* variable"
    assert builds_at_import(env, tmp_path / "a") == []
    # The same import without the image's setting starts the g++ build (the probe works).
    started = builds_at_import({}, tmp_path / "b")
    assert any("_build_optional_torch_c_dlpack" in " ".join(a) for a in started), started


def test_mooncake_libraries_are_installed_when_the_package_is(tmp_path: Path) -> None:
    steps = instructions(MUSA.read_text())
    apt = [i for i, (k, a) in enumerate(steps) if k == "RUN" and "apt-get install" in a]
    install = next(
        i
        for i, (k, a) in enumerate(steps)
        if k == "RUN" and "${MOONCAKE_PACKAGE}" in a and "pip" in a
    )
    (at,) = apt
    assert at < install, "the libraries must be there before the ldd check"
    command = steps[at][1]
    assert command.startswith('if [ -n "${MOONCAKE_PACKAGE}" ]; then')
    packages = set(re.findall(r"[\w.+-]+", command.split("--no-install-recommends", 1)[1]))
    missing = {lib: pkg for lib, pkg in MOONCAKE_LIBRARIES.items() if pkg not in packages}
    assert not missing, f"not installed: {missing}"
    # Without the package, the step installs nothing (the shell condition is false).
    done = subprocess.run(
        ["bash", "-c", command.replace("apt-get", "echo would-run apt-get")],
        env={"MOONCAKE_PACKAGE": "", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0 and "would-run" not in done.stdout


def test_the_ldd_check_runs_after_the_last_install() -> None:
    steps = instructions(MUSA.read_text())
    runs = [a for k, a in steps if k == "RUN"]
    last_pip = max(i for i, a in enumerate(runs) if "pip install" in a)
    step = runs[last_pip]
    assert step.index("native_libs.py") > step.rindex("pip install")
    assert "--dist torch_musa" in step and "--dist-prefix mooncake" in step


def test_compose_passes_the_mooncake_package_to_the_build() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name in ("hiserve", "fleet-0", "fleet-1", "bench"):
        args = compose["services"][name]["build"]["args"]
        assert args["MOONCAKE_PACKAGE"] == "${MOONCAKE_PACKAGE:-}", name
    declared = [a for k, a in instructions(MUSA.read_text()) if k == "ARG"]
    assert "MOONCAKE_PACKAGE=" in declared
