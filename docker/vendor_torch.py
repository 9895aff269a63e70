"""Keep the image's own torch: freeze it into pip constraints, then verify nothing replaced it.

Used at image build time (stdlib only, any Python >= 3.10):

  python vendor_torch.py freeze constraints.txt --require torch --require torch_musa
  pip install -c constraints.txt ...
  python vendor_torch.py verify constraints.txt --import torch_musa

``freeze`` reads ``pip freeze`` and writes ``name==version`` for the torch family (and
numpy, whose ABI the torch build depends on). Packages installed from a file or URL
(``torch @ file:///...``) are written as plain versions, because pip refuses URLs as
constraints. ``verify`` fails (exit 1) when a frozen package changed version, when
any ``nvidia-*`` package got in (a CUDA torch from PyPI brings them), or when the
listed modules no longer import on top of a torch without CUDA.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import re
import subprocess
import sys
from pathlib import Path

# Distributions whose versions must never change after the base image installed them.
FROZEN = ("torch", "torch-musa", "torchvision", "torchaudio", "triton", "pytorch-triton", "numpy")


def canonical(name: str) -> str:
    """PEP 503 normalized distribution name: ``Torch_MUSA`` -> ``torch-musa``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_freeze(text: str) -> dict[str, str]:
    """Map canonical name -> version for the FROZEN packages in ``pip freeze`` output."""
    pins: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-e", "--")):
            continue
        if "==" in line:
            name, _, version = line.partition("==")
        elif " @ " in line:
            name = line.partition(" @ ")[0]
            version = metadata.version(name.strip())
        else:
            continue
        name = canonical(name.strip())
        if name in FROZEN:
            pins[name] = version.strip()
    return pins


def freeze(out: Path, required: list[str]) -> int:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True, check=True
    ).stdout
    pins = parse_freeze(listing)
    missing = [name for name in map(canonical, required) if name not in pins]
    if missing:
        print(
            f"error: the base image lacks {', '.join(missing)}; pick a base image that "
            "ships them (for MUSA: a musa-pytorch-release-public tag).",
            file=sys.stderr,
        )
        return 1
    body = "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))
    out.write_text("# Frozen from the base image by docker/vendor_torch.py; do not edit.\n" + body)
    print(f"froze {len(pins)} packages into {out}:\n{body}", end="")
    return 0


def read_constraints(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonical(name)] = version.strip()
    return pins


def installed() -> dict[str, str]:
    """Canonical name -> version of every distribution on sys.path."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonical(name), dist.version)
    return found


def problems(pins: dict[str, str], now: dict[str, str]) -> list[str]:
    """What changed since the freeze: replaced or removed pins, and nvidia-* packages."""
    found = [
        f"{name} was {version}, now {now.get(name, 'uninstalled')}"
        for name, version in sorted(pins.items())
        if now.get(name) != version
    ]
    nvidia = sorted(name for name in now if name.startswith("nvidia-"))
    if nvidia:
        found.append("CUDA packages got in (something pulled a CUDA torch): " + ", ".join(nvidia))
    return found


def check_imports(modules: list[str]) -> list[str]:
    """Import torch then ``modules``; torch must be a build without CUDA."""
    try:
        torch = importlib.import_module("torch")
    except Exception as exc:
        return [f"import torch failed: {type(exc).__name__}: {exc}"]
    found = []
    if getattr(torch.version, "cuda", None):
        found.append(f"torch {torch.__version__} is a CUDA build (CUDA {torch.version.cuda})")
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            found.append(f"import {module} failed: {type(exc).__name__}: {exc}")
    return found


def verify(constraints: Path, modules: list[str]) -> int:
    found = problems(read_constraints(constraints), installed())
    if not found:
        found = check_imports(modules)
    for problem in found:
        print(f"error: {problem}", file=sys.stderr)
    if found:
        print(
            "The vendor torch must stay as the base image installed it: install with "
            f"`pip install -c {constraints}` and never `pip install torch`.",
            file=sys.stderr,
        )
        return 1
    print(f"vendor torch intact ({constraints}); imports ok: torch {' '.join(modules)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_freeze = sub.add_parser("freeze", help="write the constraints file")
    p_freeze.add_argument("out", type=Path)
    p_freeze.add_argument(
        "--require", action="append", default=[], help="distribution the base image must provide"
    )
    p_verify = sub.add_parser("verify", help="fail if the frozen packages changed")
    p_verify.add_argument("constraints", type=Path)
    p_verify.add_argument(
        "--import",
        dest="modules",
        action="append",
        default=[],
        help="module that must import after torch",
    )
    args = parser.parse_args(argv)
    if args.command == "freeze":
        return freeze(args.out, args.require)
    return verify(args.constraints, args.modules)


if __name__ == "__main__":
    sys.exit(main())
