"""Keep the image's own torch: freeze it into pip constraints, then verify nothing replaced it.

Used at image build time (stdlib only, any Python >= 3.10):

  python vendor_torch.py freeze constraints.txt --require torch --require torch_musa
  pip install -c constraints.txt ...
  python vendor_torch.py verify constraints.txt --require torch_musa

``freeze`` reads the installed distributions' metadata and writes ``name==version`` for
the torch family (and numpy, whose ABI the torch build depends on); packages installed
from a file or URL get plain versions too, because pip refuses URLs as constraints.
``verify`` fails (exit 1) when a frozen package changed version, a required distribution
is gone, a new ``nvidia-*`` package got in (a CUDA torch from PyPI brings them), or torch
is a CUDA build. ``nvidia-*`` packages the base image already shipped are pinned at
freeze time like the torch family, so only ones that arrived later are flagged.

NOTE: nothing here imports torch. torch >= 2.5 autoloads torch_musa (>= 2.1) inside
``import torch``, and torch_musa needs MUSA driver libraries that exist only in a
container started with the mthreads runtime, never during ``docker build``. Every check
reads package metadata and files instead.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

# Distributions whose versions must never change after the base image installed them.
FROZEN = ("torch", "torch-musa", "torchvision", "torchaudio", "triton", "pytorch-triton", "numpy")
NVIDIA_PREFIX = "nvidia-"


def canonical(name: str) -> str:
    """PEP 503 normalized distribution name: ``Torch_MUSA`` -> ``torch-musa``."""
    return re.sub(r"[-_.]+", "-", name).lower()


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


def _frozen(name: str) -> bool:
    """Pinned at freeze time: the torch family, and any nvidia-* the base image shipped."""
    return name in FROZEN or name.startswith(NVIDIA_PREFIX)


def freeze(out: Path, required: list[str]) -> int:
    now = installed()
    pins = {name: version for name, version in now.items() if _frozen(name)}
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


def problems(pins: dict[str, str], now: dict[str, str]) -> list[str]:
    """What changed since the freeze: replaced or removed pins, and nvidia-* packages
    that were not there at the freeze."""
    found = [
        f"{name} was {version}, now {now.get(name, 'uninstalled')}"
        for name, version in sorted(pins.items())
        if now.get(name) != version
    ]
    nvidia = sorted(name for name in now if name.startswith(NVIDIA_PREFIX) and name not in pins)
    if nvidia:
        found.append(
            "CUDA packages got in after the freeze (something pulled a CUDA torch): "
            + ", ".join(nvidia)
        )
    return found


def torch_cuda_version() -> str | None:
    """``torch.version.cuda`` of the installed torch, read from its file, not imported."""
    try:
        version_file = metadata.distribution("torch").locate_file("torch/version.py")
        text = Path(str(version_file)).read_text()
    except (metadata.PackageNotFoundError, OSError):
        return None
    match = re.search(r"^cuda(?:\s*:[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return match.group(1) if match else None


def metadata_problems(now: dict[str, str], required: list[str]) -> list[str]:
    """Required distributions missing, or a CUDA torch, judged from metadata only."""
    found = [
        f"{name} is not installed (the base image must provide it)"
        for name in map(canonical, required)
        if name not in now
    ]
    cuda = torch_cuda_version()
    if cuda:
        found.append(f"torch {now.get('torch', '?')} is a CUDA build (CUDA {cuda})")
    return found


def verify(constraints: Path, required: list[str]) -> int:
    now = installed()
    found = problems(read_constraints(constraints), now) + metadata_problems(now, required)
    for problem in found:
        print(f"error: {problem}", file=sys.stderr)
    if found:
        print(
            "The vendor torch must stay as the base image installed it: install with "
            f"`pip install -c {constraints}` and never `pip install torch`.",
            file=sys.stderr,
        )
        return 1
    names = ", ".join(
        f"{n} {now[canonical(n)]}" for n in ["torch", *required] if canonical(n) in now
    )
    print(f"vendor torch intact ({constraints}): {names}")
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
        "--require",
        action="append",
        default=[],
        help="distribution that must still be installed (checked in its metadata)",
    )
    args = parser.parse_args(argv)
    if args.command == "freeze":
        return freeze(args.out, args.require)
    return verify(args.constraints, args.require)


if __name__ == "__main__":
    sys.exit(main())
