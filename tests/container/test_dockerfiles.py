"""Static checks of Dockerfile.musa and docker/Dockerfile.cpu (vendor_torch.py: test_vendor_torch.py).

No Docker engine runs here, so the images are checked as text: the checker functions
below return the problems they find, and each is also run on a broken copy of the
Dockerfile to show that it does catch the problem it is about.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.container.build_rehearsal import instructions

ROOT = Path(__file__).resolve().parents[2]
MUSA = ROOT / "Dockerfile.musa"
CPU = ROOT / "docker" / "Dockerfile.cpu"
VENDOR_TORCH = ROOT / "docker" / "vendor_torch.py"
MUSA_REPO = "registry.mthreads.com/mcconline/musa-pytorch-release-public:"


def simple_commands(command: str) -> list[list[str]]:
    """The simple commands of a shell line, leading VAR=value assignments dropped."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "(", ")", "|"):
            commands.append([])
        elif commands[-1] or not re.fullmatch(r"\w+=.*", token):
            commands[-1].append(token)
    return commands


def pip_installs(run_args: str) -> list[list[str]]:
    """The argument lists of every `pip install` inside one RUN command."""
    found = []
    for words in simple_commands(run_args):  # pip / pip3 / python -m pip install
        for i in range(len(words) - 1):
            if re.fullmatch(r"(.*/)?pip3?", words[i]) and words[i + 1] == "install":
                found.append(words[i + 2 :])
    return found


def installs_torch(args: list[str]) -> bool:
    """True when a pip install names torch itself (torch_musa and the like are fine)."""
    return any(re.fullmatch(r"torch(\[[^\]]*\])?([=<>!~].*)?", a.strip("\"'")) for a in args)


def musa_problems(text: str) -> list[str]:
    """What is wrong with a Dockerfile.musa text, as readable sentences."""
    steps = instructions(text)
    problems = []
    froms = [i for i, (k, _) in enumerate(steps) if k == "FROM"]
    base_arg = next(
        (
            a
            for k, a in steps[: froms[0] if froms else 0]
            if k == "ARG" and a.startswith("BASE_IMAGE=")
        ),
        None,
    )
    if base_arg is None or not base_arg.split("=", 1)[1].startswith(MUSA_REPO):
        problems.append("no `ARG BASE_IMAGE=<torch_musa release image>` before FROM")
    if len(froms) != 1 or steps[froms[0]][1] != "${BASE_IMAGE}":
        problems.append("the image must be a single stage `FROM ${BASE_IMAGE}`")
    freeze_at = next(
        (i for i, (k, a) in enumerate(steps) if k == "RUN" and "vendor_torch.py freeze" in a), None
    )
    verify_at = next(
        (i for i, (k, a) in enumerate(steps) if k == "RUN" and "vendor_torch.py verify" in a), None
    )
    if freeze_at is None or "--require torch_musa" not in steps[freeze_at][1]:
        problems.append("torch / torch_musa are not frozen into constraints")
    install_at = []
    for i, (keyword, args) in enumerate(steps):
        if keyword != "RUN":
            continue
        for pip_args in pip_installs(args):
            install_at.append(i)
            if installs_torch(pip_args):
                problems.append(f"`pip install {' '.join(pip_args)}` installs torch")
            if "-c" not in pip_args and "--constraint" not in pip_args:
                problems.append(f"`pip install {' '.join(pip_args)}` ignores the constraints")
    if not install_at:
        problems.append("hiserve is never installed")
    elif freeze_at is None or min(install_at) < freeze_at:
        problems.append("a pip install runs before the freeze")
    if verify_at is None or (install_at and verify_at < max(install_at)):
        problems.append("no verification after the last pip install")
    elif "--require torch_musa" not in steps[verify_at][1]:
        problems.append("the verification does not check that torch_musa is still there")
    problems += autoload_problems(steps)
    find_at = next(
        (i for i, (k, a) in enumerate(steps) if k == "RUN" and "find_python.sh" in a), None
    )
    path_env = next((a for k, a in steps if k == "ENV" and "PATH=/opt/hiserve/python/bin" in a), "")
    if find_at is None or freeze_at is None or find_at > freeze_at:
        problems.append("the vendor interpreter is not found before the freeze")
    if not re.search(
        r"PATH=/opt/hiserve/python/bin:/opt/hiserve/python/prefix/bin:\$\{?PATH", path_env
    ):
        problems.append("the vendor interpreter is not first on PATH for every step and user")
    return problems + common_problems(steps)


def runs_python_code(command: str) -> bool:
    """Whether a shell command runs Python code that may import torch.

    ``pip`` and the stdlib-only build helpers (vendor_torch.py, native_libs.py,
    find_python.sh) never do.
    """
    for words in simple_commands(command):
        if not words or not re.fullmatch(r"(.*/)?python3?", words[0]):
            continue
        rest = words[1:]
        if rest[:2] == ["-m", "pip"] or (
            rest and rest[0].endswith(("vendor_torch.py", "native_libs.py"))
        ):
            continue
        return True
    return False


def autoload_problems(steps: list[tuple[str, str]]) -> list[str]:
    """RUN steps that run Python code with torch_musa's autoload on.

    torch >= 2.5 imports torch_musa inside `import torch`; no build step has the MUSA
    driver libraries, so such a step fails the build on every MUSA host.
    """
    off = "TORCH_DEVICE_BACKEND_AUTOLOAD=0"
    if any(k in ("ENV", "ARG") and off in a for k, a in steps):
        return []
    return [
        f"RUN {a[:50]}... runs Python with torch_musa's autoload on (set {off})"
        for k, a in steps
        if k == "RUN" and runs_python_code(a) and off not in a
    ]


def common_problems(steps: list[tuple[str, str]]) -> list[str]:
    """Checks both images share: health check, port, user, entrypoint, baked model."""
    problems = []
    keywords = [k for k, _ in steps]
    health = [a for k, a in steps if k == "HEALTHCHECK"]
    if not health or "healthcheck.py" not in health[-1] or "curl" in health[-1]:
        problems.append("no HEALTHCHECK running docker/healthcheck.py")
    else:
        start = re.search(r"--start-period=(\d+)s", health[-1])
        if start is None or int(start.group(1)) < 300:
            problems.append("HEALTHCHECK start period shorter than a model load")
    if ("EXPOSE", "8000") not in steps:
        problems.append("port 8000 not exposed")
    users = [a for k, a in steps if k == "USER"]
    if not users or users[-1] in ("root", "0", "0:0"):
        problems.append("the server runs as root")
    entry = [a for k, a in steps if k == "ENTRYPOINT"]
    if not entry or not entry[-1].startswith("[") or "entrypoint.py" not in entry[-1]:
        problems.append("ENTRYPOINT is not the exec-form docker/entrypoint.py")
    bake = next(
        (i for i, (k, a) in enumerate(steps) if k == "RUN" and "bake_model.py" in a),
        None,
    )
    if bake is None:
        problems.append("the default model is not baked in")
    elif "USER" not in keywords[:bake]:
        problems.append("the model is baked as root; the server user cannot update the cache")
    return problems


def test_dockerfile_musa_passes_static_checks() -> None:
    assert musa_problems(MUSA.read_text()) == []


@pytest.mark.parametrize(
    ("mutation", "expected"),
    [
        (lambda t: t.replace("FROM ${BASE_IMAGE}", "FROM python:3.10"), "FROM ${BASE_IMAGE}"),
        (
            lambda t: t.replace(
                'python -m pip install -c /opt/hiserve/constraints.txt "/opt',
                'python -m pip install "/opt',
            ),
            "ignores the constraints",
        ),
        (
            lambda t: t + "\nRUN pip install -c /opt/hiserve/constraints.txt torch==2.9.1\n",
            "installs torch",
        ),
        (lambda t: t + "\nRUN python -m pip install -c c.txt 'torch>=2'\n", "installs torch"),
        (lambda t: t + "\nRUN python -m pip install -c c.txt vllm\n", "no verification after"),
        (lambda t: re.sub(r"HEALTHCHECK.*?\n.*?\n", "", t, flags=re.S), "HEALTHCHECK"),
        (lambda t: t.replace("--require torch_musa", ""), "not frozen"),
        (lambda t: re.sub(r"(?m)^USER .*$", "USER root", t), "runs as root"),
        (
            lambda t: t.replace("RUN TORCH_DEVICE_BACKEND_AUTOLOAD=0 python", "RUN python"),
            "autoload",
        ),
        (
            lambda t: t + '\nRUN python -m pip list && python -c "import torch"\n',
            "autoload on",
        ),
        (
            lambda t: t.replace("--require torch_musa \\\n && python /opt/hiserve/native", "&& x"),
            "still there",
        ),
        (lambda t: t.replace("PATH=/opt/hiserve/python/bin:", "PATH="), "first on PATH"),
        (
            lambda t: re.sub(r"RUN sh /opt/hiserve/find_python.sh[^&]*&& ", "RUN ", t),
            "not found before the freeze",
        ),
    ],
)
def test_musa_checks_catch_broken_files(mutation: Callable[[str], str], expected: str) -> None:
    broken = mutation(MUSA.read_text())
    assert broken != MUSA.read_text(), "mutation did not apply; update the test"
    assert any(expected in p for p in musa_problems(broken)), musa_problems(broken)


def test_torch_musa_may_be_named_without_tripping_the_torch_check() -> None:
    assert not installs_torch(["torch_musa==2.9.1", "torchvision"])
    assert installs_torch(["--no-deps", "torch"])


def test_dockerfile_cpu_static_checks() -> None:
    steps = instructions(CPU.read_text())
    assert common_problems(steps) == []
    python_arg = next(a for k, a in steps if k == "ARG" and a.startswith("PYTHON_IMAGE="))
    assert re.fullmatch(r"PYTHON_IMAGE=python:3\.\d+-slim(-\w+)?", python_arg)
    torch_runs = [a for k, a in steps if k == "RUN" for p in pip_installs(a) if installs_torch(p)]
    assert len(torch_runs) == 1, "torch is installed exactly once, from the CPU index"
    assert "--index-url" in torch_runs[0] and "vendor_torch.py freeze" in torch_runs[0]
    # The image's torch is the one `make setup` pins for development.
    version = next(a for k, a in steps if k == "ARG" and a.startswith("TORCH_VERSION="))
    index = next(a for k, a in steps if k == "ARG" and a.startswith("TORCH_INDEX_URL="))
    assert index.endswith("/whl/cpu")
    pin = re.search(r"^TORCH_PIN \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert pin is not None and version == f"TORCH_VERSION={pin.group(1)}"
    for pip_args in (p for k, a in steps if k == "RUN" for p in pip_installs(a)):
        if not installs_torch(pip_args):
            assert "-c" in pip_args, f"unconstrained pip install {pip_args}"


def dockerignore_excludes(path: str) -> bool:
    """Whether .dockerignore keeps ``path`` out of the build context (last match wins)."""
    excluded = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatch(p.split("/")[-1], pattern[3:]) for p in prefixes)
        else:
            hit = any(fnmatch.fnmatch(p, pattern) for p in prefixes)
        if hit:
            excluded = not negate
    return excluded


@pytest.mark.parametrize("dockerfile", [MUSA, CPU], ids=["musa", "cpu"])
def test_copied_files_exist_and_reach_the_build_context(dockerfile: Path) -> None:
    for keyword, args in instructions(dockerfile.read_text()):
        if keyword != "COPY" or args.startswith("--from"):
            continue
        for source in args.split()[:-1]:
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source} does not exist"
            assert not dockerignore_excludes(source), f".dockerignore drops {source}"
    assert dockerignore_excludes(".venv/bin/python") and dockerignore_excludes(".git/HEAD")


@pytest.mark.parametrize("dockerfile", [MUSA, CPU], ids=["musa", "cpu"])
def test_image_has_every_module_the_entrypoint_needs(dockerfile: Path) -> None:
    # Local modules imported by the entrypoint, plus the probe script preflight runs.
    needed = {"entrypoint.py", "healthcheck.py"}
    queue = ["entrypoint.py"]
    while queue:
        tree = ast.parse((ROOT / "docker" / queue.pop()).read_text())
        for node in ast.walk(tree):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if (ROOT / "docker" / f"{name}.py").exists() and f"{name}.py" not in needed:
                    needed.add(f"{name}.py")
                    queue.append(f"{name}.py")
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and re.fullmatch(r"\w+\.py", node.value)
                and (ROOT / "docker" / node.value).exists()
            ):
                needed.add(node.value)
    assert "device_probe.py" in needed and "preflight.py" in needed
    copied = {
        Path(src).name
        for k, a in instructions(dockerfile.read_text())
        if k == "COPY"
        for src in a.split()[:-1]
        if a.split()[-1].rstrip("/") == "/opt/hiserve"
    }
    assert needed <= copied, f"not copied to /opt/hiserve: {needed - copied}"
