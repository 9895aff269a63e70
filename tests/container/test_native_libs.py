"""docker/native_libs.py, the build step of Dockerfile.musa that runs ldd on torch_musa's and
Mooncake's native modules: a library that is not found fails the build, except those the
mthreads runtime injects at container start. Run against fake distributions, with a fake
ldd (its canned output) and with the real ldd on shared objects built here."""

from __future__ import annotations

import ast
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docker" / "native_libs.py"
STORE_LDD = """\tlinux-vdso.so.1 (0x00007ffd5b3f2000)
\tlibmusart.so.5 => /usr/local/musa/lib/libmusart.so.5 (0x00007f1c2a000000)
\tlibibverbs.so.1 => not found
\tlibnuma.so.1 => not found
\tlibmusa.so.1 => not found
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f1c29c00000)
"""


def fake_dist(site: Path, name: str, files: list[str]) -> list[Path]:
    """A distribution with the given files on disk and in its RECORD."""
    dist = site / f"{name.replace('-', '_')}-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    paths = [site / f for f in files]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x7fELF")
    return paths


def run_check(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        # -S: no site-packages, so only the fake distributions are found.
        [sys.executable, "-S", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1"},
        timeout=120,
        check=False,
    )


@pytest.fixture
def fake_ldd(tmp_path: Path) -> Path:
    """An ldd that prints STORE_LDD for any file named store*.so and nothing missing else."""
    script = tmp_path / "bin" / "ldd"
    script.parent.mkdir()
    (tmp_path / "store.txt").write_text(STORE_LDD)
    script.write_text(
        "#!/bin/sh\n"
        f'case "$(basename "$1")" in store*) cat {tmp_path / "store.txt"} ;; '
        "*) echo '\tlibc.so.6 => /lib/libc.so.6 (0x1)' ;; esac\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_a_missing_library_fails_and_is_named(tmp_path: Path, fake_ldd: Path) -> None:
    site = tmp_path / "site"
    fake_dist(site, "torch_musa", ["torch_musa/lib/libmusa_kernels.so", "torch_musa/__init__.py"])
    (store,) = fake_dist(site, "mooncake-transfer-engine-musa", ["mooncake/store.so"])
    args = ("--dist", "torch_musa", "--dist-prefix", "mooncake", "--ldd", str(fake_ldd))
    done = run_check(site, *args)
    assert done.returncode == 1
    assert f"{store}: libibverbs.so.1, libnuma.so.1 not found" in done.stderr
    # libmusa.so.1 comes from the mthreads runtime at `docker run`: never a build failure.
    assert "libmusa.so.1" not in done.stderr and "libmusa_kernels" not in done.stderr
    allowed = run_check(site, *args, "--allow", "libibverbs.so.*", "--allow", "libnuma.so.1")
    assert allowed.returncode == 0, allowed.stderr
    assert "2 native modules find their libraries" in allowed.stdout


def test_no_mooncake_installed_is_fine_but_a_named_dist_must_be(
    tmp_path: Path, fake_ldd: Path
) -> None:
    site = tmp_path / "site"
    fake_dist(site, "torch_musa", ["torch_musa/_MUSAC.cpython-310-x86_64-linux-gnu.so"])
    done = run_check(
        site, "--dist", "torch_musa", "--dist-prefix", "mooncake", "--ldd", str(fake_ldd)
    )
    assert done.returncode == 0, done.stderr
    done = run_check(site, "--dist", "torch_musa", "--dist", "mooncake-transfer-engine-musa")
    assert done.returncode == 1 and "mooncake-transfer-engine-musa is not installed" in done.stderr


def test_the_real_ldd_on_a_module_whose_library_is_gone(tmp_path: Path) -> None:
    """A shared object linked against a library that then disappears, as in an image
    without the package: the system's ldd reports it, the check names it."""
    compiler, ldd = shutil.which("cc") or shutil.which("gcc"), shutil.which("ldd")
    if compiler is None or ldd is None:
        pytest.skip("needs a C compiler and ldd")
    soname = "libhiserve_fake_verbs.so.1"  # a name no system has
    stub_dir, site = tmp_path / "stub", tmp_path / "site"
    stub_dir.mkdir()
    (tmp_path / "stub.c").write_text("int verbs_stub(void) { return 0; }\n")
    (tmp_path / "store.c").write_text(
        "int verbs_stub(void);\nint store(void) { return verbs_stub(); }\n"
    )
    cc = [compiler, "-shared", "-fPIC"]
    stub = stub_dir / soname
    subprocess.run(
        [*cc, f"-Wl,-soname,{soname}", "-o", str(stub), str(tmp_path / "stub.c")], check=True
    )
    (store,) = fake_dist(site, "mooncake-transfer-engine-musa", ["mooncake/store.so"])
    rpath = f"-Wl,-rpath,{stub_dir}"
    subprocess.run([*cc, rpath, "-o", str(store), str(tmp_path / "store.c"), str(stub)], check=True)
    done = run_check(site, "--dist-prefix", "mooncake")
    assert done.returncode == 0, done.stderr  # found through the rpath it was linked with
    stub.unlink()
    done = run_check(site, "--dist-prefix", "mooncake")
    assert done.returncode == 1 and f"{store}: {soname} not found" in done.stderr


def test_native_libs_never_imports_torch() -> None:
    tree = ast.parse(SCRIPT.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m.split(".")[0] in ("torch", "torch_musa")}
