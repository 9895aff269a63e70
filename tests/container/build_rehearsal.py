"""A rehearsal of Dockerfile.musa's build on this machine, without Docker or MUSA.

The Dockerfile's instructions run in order in a scratch directory that stands in for the
image's filesystem: every absolute path under ``MAPPED_ROOTS`` (``/opt/hiserve``,
``/opt/conda``, ...) is rewritten to the same path below the scratch root. The "base
image" is a vendor-style interpreter in a conda-style location
(``/opt/conda/envs/py311``), not on PATH, holding the CPU torch, an older numpy and a
fake ``torch_musa`` that registers the real ``torch.backends`` entry point and, when
imported, records it and fails like a torch_musa without its driver libraries (which no
``docker build`` step has). A build that imports torch with autoload on, or imports
torch_musa at all, fails here as it would on a MUSA host.

Steps that administer the system (users, groups, apt) are not run: the static checks in
test_dockerfiles.py cover them. ``USER`` is recorded, not switched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAPPED_ROOTS = ("/opt/hiserve", "/opt/conda", "/var/cache/hiserve", "/models")
# The base image's PATH: conda's base bin first (as the vendor's release recipe sets it),
# the env that holds torch nowhere on it.
BASE_PATH = "/opt/conda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
VENDOR_ENV = "/opt/conda/envs/py311"
TORCH_MUSA_VERSION = "2.9.1"
# The numpy older vendor recipes pinned (1.23.1, cp310 only); 1.23.5 is the same API
# with wheels for this machine's Python.
VENDOR_NUMPY = "1.23.5"
DRIVER_ERROR = "libmusa.so.1: cannot open shared object file: No such file or directory"
ADMIN_COMMANDS = re.compile(r"\b(useradd|groupadd|apt-get|chown)\b")
_MAPPED = re.compile(r"(?<![\w/.-])(" + "|".join(map(re.escape, MAPPED_ROOTS)) + r")(?=/|\b|$)")
_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


class RehearsalError(Exception):
    """A build step failed; the message names it and carries its output."""


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not pending and not stripped):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, args = (pending + stripped).partition(" ")
        pending = ""
        out.append((keyword.upper(), args.strip()))
    return out


@dataclass
class Image:
    """The scratch filesystem and the build's state after the instructions ran."""

    root: Path
    env: dict[str, str]
    cwd: Path
    user: str = "root"
    entrypoint: list[str] = field(default_factory=list)
    healthcheck: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def path(self, image_path: str) -> Path:
        """Where an absolute path of the image lives in the scratch directory."""
        return Path(self.rewrite(image_path))

    def rewrite(self, text: str) -> str:
        return _MAPPED.sub(lambda m: f"{self.root}{m.group(1)}", text)

    def expand(self, text: str) -> str:
        return _VAR.sub(lambda m: self.env.get(m.group(1) or m.group(2), ""), text)

    @property
    def torch_musa_imports(self) -> list[dict]:
        """Every import of the fake torch_musa so far, as recorded by the fake itself."""
        marker = self.root / "torch_musa_imports.jsonl"
        if not marker.exists():
            return []
        return [json.loads(line) for line in marker.read_text().splitlines()]

    def run(self, command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a shell command as a RUN step would (bash -o pipefail -c)."""
        return subprocess.run(
            ["bash", "-o", "pipefail", "-c", self.rewrite(command)],
            cwd=self.cwd,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )


def make_base(root: Path) -> Image:
    """The stand-in for a torch_musa release image: a conda-style env off PATH."""
    image = Image(root=root, env={}, cwd=root)
    image.env = {
        "PATH": image.rewrite(BASE_PATH),
        "HOME": str(root / "root"),
        "LANG": "C.UTF-8",
    }
    # This machine reaches PyPI through its own pip settings; keep them.
    image.env.update({k: v for k, v in os.environ.items() if k.startswith("PIP_")})
    (root / "root").mkdir(parents=True, exist_ok=True)
    for mapped in MAPPED_ROOTS:
        image.path(mapped).mkdir(parents=True, exist_ok=True)
    vendor = image.path(VENDOR_ENV)
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "python3"
    # conda's base interpreter, first on PATH and without torch, as in the vendor images.
    _check([python, "-m", "venv", "--without-pip", str(image.path("/opt/conda"))], "create conda")
    _check([python, "-m", "venv", str(vendor)], "create the vendor env")
    # Same wheel `make setup` installs (the machine's pip settings find it locally).
    _check(
        [
            str(vendor / "bin/python"),
            "-m",
            "pip",
            "install",
            "-q",
            _torch_pin(),
            f"numpy=={VENDOR_NUMPY}",
        ],
        "install the vendor torch",
    )
    site = Path(
        subprocess.check_output(
            [
                str(vendor / "bin/python"),
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ],
            text=True,
        ).strip()
    )
    _fake_torch_musa(site, root / "torch_musa_imports.jsonl")
    return image


def _torch_pin() -> str:
    match = re.search(r"^TORCH_PIN \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, "Makefile has no TORCH_PIN"
    return match.group(1)


def _fake_torch_musa(site: Path, marker: Path) -> None:
    """A torch_musa that autoloads like the real one and fails like a driver-less one."""
    package = site / "torch_musa"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import json, os, sys\n"
        f"with open({str(marker)!r}, 'a') as f:\n"
        "    f.write(json.dumps({'argv': sys.argv, 'autoload': "
        "os.environ.get('TORCH_DEVICE_BACKEND_AUTOLOAD')}) + '\\n')\n"
        f"raise ImportError({DRIVER_ERROR!r})\n"
    )
    dist = site / f"torch_musa-{TORCH_MUSA_VERSION}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: torch_musa\nVersion: {TORCH_MUSA_VERSION}\n"
    )
    (dist / "entry_points.txt").write_text("[torch.backends]\ntorch_musa = torch_musa:_autoload\n")
    (dist / "INSTALLER").write_text("vendor\n")
    (dist / "RECORD").write_text("")


def _check(argv: list[str], what: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise RehearsalError(f"could not {what}: {done.stdout[-2000:]}{done.stderr[-2000:]}")


def build(dockerfile_text: str, image: Image, build_args: dict[str, str] | None = None) -> Image:
    """Run the Dockerfile's instructions on ``image``; raise RehearsalError at a failed RUN."""
    args = dict(build_args or {})
    seen_from = False
    for keyword, text in instructions(dockerfile_text):
        if keyword == "FROM":
            seen_from = True
        elif keyword == "ARG" and seen_from:
            name, _, default = text.partition("=")
            image.env[name] = args.get(name, default.strip("\"'"))
        elif keyword == "ENV":
            for name, value in _env_pairs(text):
                image.env[name] = image.rewrite(image.expand(value))
        elif keyword == "WORKDIR":
            image.cwd = image.path(image.expand(text))
            image.cwd.mkdir(parents=True, exist_ok=True)
        elif keyword == "COPY":
            _copy(image, text.split())
        elif keyword == "RUN":
            _run(image, text)
        elif keyword == "USER":
            image.user = image.expand(text)
        elif keyword == "ENTRYPOINT":
            image.entrypoint = [image.rewrite(a) for a in json.loads(text)]
        elif keyword == "HEALTHCHECK":
            image.healthcheck = [image.rewrite(a) for a in json.loads(text.split(" CMD ", 1)[1])]
    return image


def _env_pairs(text: str) -> list[tuple[str, str]]:
    pairs = []
    for word in re.findall(r'(?:[^\s"]|"[^"]*")+', text):
        name, _, value = word.partition("=")
        pairs.append((name, value.strip('"')))
    return pairs


def _copy(image: Image, words: list[str]) -> None:
    *sources, dest_text = words
    dest = image.path(image.expand(dest_text))
    for source in sources:
        src = ROOT / source
        if src.is_dir():
            shutil.copytree(
                src, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            target = dest / src.name if dest_text.endswith("/") or len(sources) > 1 else dest
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def _run(image: Image, text: str) -> None:
    if ADMIN_COMMANDS.search(text):
        image.log.append(f"skipped (system administration): RUN {text[:60]}...")
        return
    done = image.run(text)
    image.log.append(f"RUN {text[:60]}... -> {done.returncode}")
    if done.returncode != 0:
        raise RehearsalError(
            f"RUN {text}\nfailed with exit code {done.returncode}:\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )


def main() -> int:
    """``python tests/container/build_rehearsal.py SCRATCH``: rehearse and report."""
    root = Path(sys.argv[1]).resolve()
    image = build((ROOT / "Dockerfile.musa").read_text(), make_base(root))
    print("\n".join(image.log))
    print(f"torch_musa imports during the build: {image.torch_musa_imports}")
    return 1 if image.torch_musa_imports else 0


if __name__ == "__main__":
    sys.exit(main())
