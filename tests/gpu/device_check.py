"""The device check: every GPU-only path of hiserve on a CUDA machine, in one command.

    make device-check        (or: python3 tests/gpu/device_check.py)

Uses the machine's own python3 and torch (never a venv, never installs anything), runs
only tests/gpu/, and prints one short report: what ran, host-tier copy GB/s against one
large copy, decode tokens/s and inter-token latency at batch 1 and 32, with CUDA graphs
and without (tests/gpu/test_gpu_graphs.py). Exits at once, non-zero, when no CUDA device
is visible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_TESTS = Path(__file__).resolve().parent
EXIT_NO_DEVICE = 3
# A folder that keeps the figures (one JSON object a line, written as each is measured,
# so a run cut short still leaves them) and pytest's JUnit XML (written when it ends).
KEEP_ENV = "HISERVE_DEVICE_CHECK_DIR"


def cuda_problem() -> str | None:
    """Why this machine cannot run the check, or None."""
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken CUDA install raising at import
        return f"torch cannot be imported with {sys.executable} ({exc})"
    if getattr(torch.version, "hip", None):
        return f"torch {torch.__version__} is a ROCm build; the device check needs CUDA"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        return (
            f"no CUDA device is visible to torch {torch.__version__} (CUDA "
            f"{torch.version.cuda}, CUDA_VISIBLE_DEVICES={visible})"
        )
    return None


def pytest_command(junit: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-ra",
        "-p",
        "no:cacheprovider",
        "-c",
        str(GPU_TESTS / "pytest.ini"),
        "--rootdir",
        str(ROOT),
        "--confcutdir",
        str(GPU_TESTS),
        f"--junitxml={junit}",
        str(GPU_TESTS),
    ]


def outcomes(junit: Path) -> list[tuple[str, str, float]]:
    """(test, passed|failed|skipped, seconds) from pytest's JUnit XML."""
    if not junit.is_file():
        return []
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        state = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                state = "skipped" if tag == "skipped" else "failed"
        rows.append((case.get("name", "?"), state, float(case.get("time", 0))))
    return rows


def report(rows: list[tuple[str, str, float]], figures_file: Path, seconds: float) -> str:
    import torch

    lines = [
        "",
        "=" * 72,
        f"hiserve device check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, {seconds:.0f} s",
        "-" * 72,
    ]
    counts = {
        state: sum(1 for r in rows if r[1] == state) for state in ("passed", "failed", "skipped")
    }
    lines.append(
        f"tests: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    )
    lines += [f"  {state:7s} {name} ({secs:.1f} s)" for name, state, secs in rows]
    lines.append("-" * 72)
    if figures_file.is_file():
        for line in figures_file.read_text(encoding="utf-8").splitlines():
            figure = json.loads(line)
            lines.append(f"  {figure['name']}: {figure['value']} {figure['unit']}".rstrip())
    else:
        lines.append("  no figures recorded")
    lines.append("=" * 72)
    return "\n".join(lines)


def main() -> int:
    problem = cuda_problem()
    if problem is not None:
        print(
            f"device-check: {problem}.\nIt runs only on a machine with an NVIDIA GPU and a "
            "CUDA build of torch; nothing was tested.",
            file=sys.stderr,
        )
        return EXIT_NO_DEVICE
    kept = os.environ.get(KEEP_ENV)
    with tempfile.TemporaryDirectory(prefix="hiserve-device-check-") as scratch:
        folder = Path(kept or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        junit = folder / "junit.xml"
        figures_file = folder / "figures.jsonl"
        env = dict(os.environ)
        env["HISERVE_DEVICE_REPORT"] = str(figures_file)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        start = time.monotonic()
        rc = subprocess.call(pytest_command(junit), cwd=ROOT, env=env)
        print(report(outcomes(junit), figures_file, time.monotonic() - start))
    return rc


if __name__ == "__main__":
    sys.exit(main())
