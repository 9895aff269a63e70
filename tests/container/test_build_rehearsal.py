"""Dockerfile.musa's build, rehearsed against a torch_musa that fails like a driver-less one.

See build_rehearsal.py for how the build runs without Docker or MUSA. One build per
module (about a minute and a half); each test then checks one promise of the image.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.container.build_rehearsal import (
    BASE_PATH,
    DRIVER_ERROR,
    ROOT,
    TORCH_MUSA_VERSION,
    VENDOR_ENV,
    VENDOR_NUMPY,
    Image,
    build,
    instructions,
    make_base,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Image, list[dict]]:
    """The rehearsed image, and the torch_musa imports recorded by the build itself
    (taken right after it: later tests import it on purpose)."""
    image = build((ROOT / "Dockerfile.musa").read_text(), make_base(tmp_path_factory.mktemp("img")))
    return image, list(image.torch_musa_imports)


@pytest.fixture
def image(built: tuple[Image, list[dict]]) -> Image:
    return built[0]


@pytest.fixture
def imports_during_build(built: tuple[Image, list[dict]]) -> list[dict]:
    return built[1]


def test_the_build_never_imports_torch_musa(image: Image, imports_during_build: list) -> None:
    assert imports_during_build == [], "a build step imported torch_musa (autoload or directly)"
    pins = image.path("/opt/hiserve/constraints.txt").read_text()
    assert f"torch-musa=={TORCH_MUSA_VERSION}" in pins.splitlines()
    assert f"numpy=={VENDOR_NUMPY}" in pins.splitlines()
    assert re.search(r"^torch==2\.13\.0", pins, re.M)
    # The default model was baked (converted) by the server user's step, in both layouts:
    # the full one and the packed one --dtype auto serves on a CPU.
    baked = sorted(
        p.parent.name for p in image.path("/var/cache/hiserve").glob("models/*/config.json")
    )
    assert len(baked) == 2 and baked[1] == f"{baked[0]}-packed", baked


def test_the_vendor_interpreter_runs_every_later_step_and_user(image: Image) -> None:
    vendor = image.path(VENDOR_ENV)
    done = image.run("python -c 'import sys; print(sys.prefix)' && command -v hiserve-bench")
    assert done.returncode == 0, done.stderr
    prefix, bench = done.stdout.split()
    assert Path(prefix).resolve() == vendor.resolve()
    assert Path(bench).resolve() == (vendor / "bin" / "hiserve-bench").resolve()
    # Exec-form ENTRYPOINT and HEALTHCHECK find `python` on the image's PATH, not a shell.
    for argv in (image.entrypoint, image.healthcheck):
        found = shutil.which(argv[0], path=image.env["PATH"])
        assert found is not None and found.startswith(str(image.path("/opt/hiserve/python")))


def test_without_the_interpreter_search_the_freeze_finds_no_torch(image: Image) -> None:
    # Yesterday's step 1: `python` on the base image's PATH is not the conda env's.
    done = image.run(
        "python /opt/hiserve/vendor_torch.py freeze /tmp/c.txt --require torch",
        env={"PATH": image.rewrite(BASE_PATH)},
    )
    assert done.returncode == 1
    assert "the base image lacks torch" in done.stderr


def test_find_python_says_what_to_do_when_no_interpreter_has_torch(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            "sh",
            str(ROOT / "docker" / "find_python.sh"),
            str(tmp_path / "py"),
            "/usr/bin/true",
            str(tmp_path / "missing" / "python"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "no Python interpreter in this base image has torch" in done.stderr
    assert "--build-arg PYTHON=" in done.stderr and not (tmp_path / "py").exists()


@pytest.mark.parametrize(
    "step",
    [
        # Yesterday's step 4: the model conversion imported torch with autoload on.
        "python -c \"from engine.loader import resolve_model_path; print(resolve_model_path('default'))\"",
        # Autoload off is not enough: accelerate imports torch_musa when it is installed.
        'TORCH_DEVICE_BACKEND_AUTOLOAD=0 python -c "from engine.loader import resolve_model_path; '
        "print(resolve_model_path('default'))\"",
    ],
    ids=["autoload", "accelerate"],
)
def test_a_step_that_imports_torch_musa_fails_the_rehearsal(image: Image, step: str) -> None:
    before = len(image.torch_musa_imports)
    done = image.run(step, env={"HISERVE_CACHE_DIR": str(image.root / "other-cache")})
    assert done.returncode != 0
    assert DRIVER_ERROR in done.stderr
    assert len(image.torch_musa_imports) == before + 1


def _entrypoint(image: Image, scripts: Path, device: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["python", str(scripts / "entrypoint.py")],
        env={**image.env, "HISERVE_DEVICE": device, "HISERVE_PREFLIGHT": "only"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_preflight_in_the_image_blames_the_driver(image: Image) -> None:
    scripts = image.path("/opt/hiserve")
    done = _entrypoint(image, scripts, "musa:0")
    assert done.returncode == 3, done.stderr
    assert "torch_musa is installed but failed to import" in done.stderr
    assert DRIVER_ERROR in done.stderr and "the image is broken" not in done.stderr
    assert _entrypoint(image, scripts, "cpu").returncode == 0


def test_preflight_with_autoload_on_would_blame_the_image(image: Image, tmp_path: Path) -> None:
    # The probe as it was before it turned the autoload off: the driver problem surfaces
    # inside `import torch` and the operator is told the image is broken.
    for name in ("entrypoint.py", "preflight.py", "device_probe.py"):
        shutil.copy2(image.path(f"/opt/hiserve/{name}"), tmp_path / name)
    probe = tmp_path / "device_probe.py"
    text = probe.read_text()
    autoload_off = 'os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"'
    assert autoload_off in text
    probe.write_text(text.replace(autoload_off, "pass"))
    done = _entrypoint(image, tmp_path, "musa:0")
    assert done.returncode == 3
    assert "torch failed to import" in done.stderr and "the image is broken" in done.stderr


def test_the_numpy_floor_admits_the_vendor_numpy() -> None:
    # The build resolved against VENDOR_NUMPY; the floor must also admit 1.23.1, the
    # numpy older vendor recipes pinned (no wheel of it exists for this Python).
    floor = re.search(r'"numpy>=([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert floor is not None, "pyproject.toml: numpy needs a lower bound"
    as_tuple = tuple(int(p) for p in floor.group(1).split("."))
    assert as_tuple <= (1, 23, 1) and VENDOR_NUMPY.startswith("1.23.")


def test_the_ldd_step_fails_the_build_on_a_native_module_that_cannot_load(
    image: Image, tmp_path: Path
) -> None:
    """The Dockerfile's own ldd step, re-run in the built image after a torch_musa native
    module that links a library the image lacks was added to the vendor torch_musa."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler")
    dockerfile = (ROOT / "Dockerfile.musa").read_text()
    (step,) = [a for k, a in instructions(dockerfile) if k == "RUN" and "native_libs" in a]
    command = step[step.index("python /opt/hiserve/native_libs.py") :]
    assert image.run(command).returncode == 0  # as in the build: nothing missing
    soname = "libhiserve_missing_in_image.so.5"
    stub = tmp_path / soname
    (tmp_path / "a.c").write_text("int musa_stub(void) { return 0; }\n")
    (tmp_path / "b.c").write_text(
        "int musa_stub(void);\nint kernel(void) { return musa_stub(); }\n"
    )
    subprocess.run(
        [
            compiler,
            "-shared",
            "-fPIC",
            f"-Wl,-soname,{soname}",
            "-o",
            str(stub),
            str(tmp_path / "a.c"),
        ],
        check=True,
    )
    pattern = f"lib/python*/site-packages/torch_musa-{TORCH_MUSA_VERSION}.dist-info"
    dist_info = next(image.path(VENDOR_ENV).glob(pattern))
    module = dist_info.parent / "torch_musa" / "lib" / "libmusa_kernels.so"
    module.parent.mkdir(exist_ok=True)
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", str(module), str(tmp_path / "b.c"), str(stub)],
        check=True,
    )
    record = dist_info / "RECORD"
    before = record.read_text()
    record.write_text(before + "torch_musa/lib/libmusa_kernels.so,,\n")
    try:
        done = image.run(command)
    finally:
        record.write_text(before)
        module.unlink()
    assert done.returncode == 1
    assert f"{module}: {soname} not found" in done.stderr


def test_the_image_installs_every_native_kernel_source(image: Image) -> None:
    # The CPU kernels are compiled on first use from the installed package's csrc: a
    # header left out of the wheel (package-data) fails every build that includes it.
    installed = next(image.path(VENDOR_ENV).glob("lib/python*/site-packages/engine/layers/csrc"))
    sources = sorted(p.name for p in (ROOT / "engine" / "layers" / "csrc").iterdir())
    assert any(name.endswith(".h") for name in sources)
    assert sorted(p.name for p in installed.iterdir() if p.suffix in (".cpp", ".h")) == [
        name for name in sources if name.endswith((".cpp", ".h"))
    ]
