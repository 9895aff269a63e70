"""Every Triton launch the engine makes, at the shapes of the model families it serves,
compiled for real GPU targets with no GPU (python -m bench.micro.kernel_resources): an
H100/H200 (sm90), an L40S/RTX 4090 (sm89, 99 KiB of shared memory a block) and an MI300X
(gfx942, 64 KiB). The interpreter the other kernel tests use accepts what a GPU compiler
rejects and has no shared memory; this is where a kernel that would not build or load
on the device fails CI."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")

from bench.micro import kernel_resources
from bench.micro.kernel_resources import DTYPES, SHAPES, STEPS

STEP_NAMES = [step for step, _, _ in STEPS]

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {
    "_paged_attention_kernel",
    "_merge_splits_kernel",
    "_add_rms_norm_kernel",
    "_silu_mul_kernel",
    "_rotary_kernel",
    "_store_kv_kernel",
    "_rotary_store_kernel",
    "_expert_matmul_kernel",
}


@pytest.fixture(scope="module")
def launches() -> dict[str, list[dict[str, Any]]]:
    """The launches of each target, compiled in two processes at once (one per core)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.micro.kernel_resources", "--json", "--target", *group],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for group in (["sm90"], ["sm89", "gfx942"])
    ]
    found: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        out, err = run.communicate(timeout=900)
        reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        found.update({r["target"]: r["launches"] for r in reports})
        assert run.returncode == 0 or reports, err[-3000:]
    return found


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("target", ["sm90", "sm89", "gfx942"])
def test_every_launch_compiles_and_fits_the_target(
    target: str, launches: dict[str, list[dict[str, Any]]]
) -> None:
    rows = launches[target]
    broken = [r for r in rows if not r["compiled"] or r["shared_bytes"] > r["shared_limit"]]
    assert broken == []
    assert {r["kernel"] for r in rows} == KERNELS
    # Rows are kernels no earlier launch compiled; every family, dtype and step has one.
    launched = {(r["shape"], r["dtype"], r["variant"]) for r in rows}
    dtypes = {str(d).removeprefix("torch.") for d in DTYPES}
    assert launched == set(itertools.product((s.name for s in SHAPES), dtypes, STEP_NAMES))


def test_the_measured_gpu_keeps_the_first_options(
    launches: dict[str, list[dict[str, Any]]],
) -> None:
    # The H100/H200 figures are of the largest blocks: half precision never falls back.
    half = [r for r in launches["sm90"] if r["dtype"] != "float32"]
    assert half and all(r["refused"] == 0 for r in half)


def test_smaller_gpus_take_smaller_options_where_the_first_do_not_fit(
    launches: dict[str, list[dict[str, Any]]],
) -> None:
    # float32 attention with 128- and 256-wide heads needs more than 99 KiB a block with
    # its first options; these launches fitted only by the fallback.
    for target in ("sm89", "gfx942"):
        fell_back = {
            (r["shape"], r["variant"])
            for r in launches[target]
            if r["refused"] and r["kernel"] == "_paged_attention_kernel"
        }
        assert ("Gemma-2-2B", "prefill") in fell_back
        assert ("Llama-3-8B", "prefill") in fell_back


def test_a_shared_memory_limit_can_replace_the_targets(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # For a device whose limit is known but whose compiler is not on PyPI (MUSA): the
    # launches of a target compiled as if its blocks had that much shared memory.
    asked: list[tuple[str, int | None]] = []

    def compile_all(target: str, shared_limit: int | None = None) -> list[Any]:
        asked.append((target, shared_limit))
        return []

    monkeypatch.setattr(kernel_resources, "compile_all", compile_all)
    assert kernel_resources.main(["--target", "sm89", "gfx942", "--shared-limit", "32768"]) == 0
    assert asked == [("sm89", 32768), ("gfx942", 32768)]
    kernel_resources.main(["--target", "sm90"])
    assert asked[-1] == ("sm90", None)  # the target's own limit
    capsys.readouterr()
