"""Check at image build time that the installed native modules find their shared libraries.

Used in Dockerfile.musa after the last pip install (stdlib only, any Python >= 3.10):

  python native_libs.py --dist torch_musa --dist-prefix mooncake

Every native module (``*.so``, ``*.so.N``) that the named distributions installed goes
through ``ldd``; a library it reports ``not found`` fails the build (exit 1), naming the
module and the library, unless it is one the mthreads container runtime injects when a
container starts (the MUSA driver's user-space libraries): no ``docker build`` step has
those, so their absence here says nothing. A wheel built for another MUSA SDK shows up
here as a missing ``libmusart.so.N``, and a client library without its system packages
as, for example, a missing ``libibverbs.so.1``.

NOTE: nothing here imports torch (torch_musa would autoload without its driver).
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

# Injected by the mthreads runtime at `docker run` (MTHREADS_DRIVER_CAPABILITIES=compute,
# utility): the driver API, its user-mode service library and the management library.
RUNTIME_INJECTED = ("libmusa.so*", "libsrv_um_*.so*", "libmtml.so*")
_NATIVE = re.compile(r"\.so(\.\d+)*$")
_NOT_FOUND = re.compile(r"^\s*(\S+)\s+=>\s+not found\s*$", re.M)


def canonical(name: str) -> str:
    """PEP 503 normalized distribution name: ``Torch_MUSA`` -> ``torch-musa``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def native_modules(names: list[str], prefixes: list[str]) -> tuple[list[Path], list[str]]:
    """The native files of the distributions named exactly or by prefix, and the exactly
    named ones that are not installed."""
    wanted, starts = {canonical(n) for n in names}, [canonical(p) for p in prefixes]
    found: list[Path] = []
    seen: set[str] = set()
    for dist in metadata.distributions():
        name = canonical(dist.metadata["Name"] or "")
        if name in seen or not (name in wanted or any(name.startswith(p) for p in starts)):
            continue
        seen.add(name)
        for file in dist.files or []:
            path = Path(str(dist.locate_file(file)))
            if _NATIVE.search(file.name) and path.is_file():
                found.append(path)
    return sorted(found), sorted(wanted - seen)


def missing_libraries(ldd_output: str) -> list[str]:
    """Libraries ``ldd`` reports as ``not found``."""
    return _NOT_FOUND.findall(ldd_output)


def problems(modules: list[Path], ldd: str, allowed: tuple[str, ...]) -> list[str]:
    """One line per module with a missing library that is not allowed to be missing."""
    found = []
    for module in modules:
        done = subprocess.run(
            [ldd, str(module)], capture_output=True, text=True, timeout=60, check=False
        )
        missing = [
            lib
            for lib in missing_libraries(done.stdout + done.stderr)
            if not any(fnmatch.fnmatch(lib, pattern) for pattern in allowed)
        ]
        if missing:
            found.append(f"{module}: {', '.join(missing)} not found")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dist", action="append", default=[], help="distribution to check")
    parser.add_argument(
        "--dist-prefix",
        action="append",
        default=[],
        help="check every installed distribution whose name starts with this (may be none)",
    )
    parser.add_argument(
        "--allow",
        action="append",
        default=[],
        help="library name pattern that may be missing, beyond the runtime-injected ones",
    )
    parser.add_argument("--ldd", default="ldd", help="the ldd to run")
    args = parser.parse_args(argv)
    ldd = shutil.which(args.ldd)
    if ldd is None:
        print(f"error: {args.ldd} not found; it ships with the C library", file=sys.stderr)
        return 1
    modules, absent = native_modules(args.dist, args.dist_prefix)
    found = [f"{name} is not installed" for name in absent]
    found += problems(modules, ldd, RUNTIME_INJECTED + tuple(args.allow))
    for problem in found:
        print(f"error: {problem}", file=sys.stderr)
    if found:
        print(
            "A native module cannot load: install the system package that provides the "
            "library (Dockerfile.musa installs Mooncake's when MOONCAKE_PACKAGE is set), or "
            "pick a base image whose MUSA SDK has it (a missing libmusart.so.N means the "
            "wheel was built for SDK N).",
            file=sys.stderr,
        )
        return 1
    print(f"{len(modules)} native modules find their libraries (ldd)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
