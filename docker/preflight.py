"""Preflight for the container entrypoint: parse the device, check it is usable.

Stdlib only. torch is imported only in a child process (``device_probe.py``) with a
timeout, after ``MUSA_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES`` are set: those take
effect only when set before torch's first import. Every failure becomes a
``PreflightError`` whose text says what is missing and how to fix it.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# The same forms engine/platform.py accepts (hip is ROCm; cpu:N means cpu).
DEVICE_TYPES = ("auto", "cpu", "cuda", "hip", "musa", "npu", "xpu", "mps")
VALID_DEVICES_TEXT = "auto, cpu, cuda[:N], hip[:N], musa[:N], npu[:N], xpu[:N], mps"
# Which variable restricts the process to one GPU, per device type.
VISIBLE_DEVICES_VAR = {
    "musa": "MUSA_VISIBLE_DEVICES",
    "cuda": "CUDA_VISIBLE_DEVICES",
    "hip": "HIP_VISIBLE_DEVICES",
}
# torch reaches ROCm GPUs through torch.cuda.
PROBE_TYPE = {"hip": "cuda"}
# The Python module that adds each backend to torch (absent: built into torch).
BACKEND_MODULE = {"musa": "torch_musa", "npu": "torch_npu"}
AUTO_ORDER = ("cuda", "musa", "npu", "xpu", "mps")
EXIT_BAD_CONFIG = 2
EXIT_NO_DEVICE = 3
PROBE_SCRIPT = Path(__file__).with_name("device_probe.py")
# Where MUSA GPUs appear in a container (the vendor's docs: /dev/mtgpu*, /dev/dri/*).
MUSA_DEVICE_NODES = ("/dev/mtgpu*", "/dev/dri/card*", "/dev/dri/renderD*")


class PreflightError(Exception):
    """A problem the operator must fix; carries the exit code and a full message."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed device string: bare type plus optional index."""

    type: str
    index: int | None = None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


def parse_device(text: str) -> DeviceSpec:
    """Parse ``musa:1`` / ``CUDA`` / ``auto`` without torch; raise PreflightError if invalid."""
    name, sep, index_text = text.strip().lower().partition(":")
    if name not in DEVICE_TYPES:
        raise PreflightError(_bad_device_message(text), EXIT_BAD_CONFIG)
    if not sep:
        return DeviceSpec(name)
    if name == "auto" or not (index_text.isascii() and index_text.isdigit()):
        raise PreflightError(_bad_device_message(text), EXIT_BAD_CONFIG)
    return DeviceSpec(name, None if name == "cpu" else int(index_text))


def _bad_device_message(text: str) -> str:
    return (
        f"HISERVE_DEVICE={text!r} is not a valid device. "
        f"Valid values: {VALID_DEVICES_TEXT} (N is a GPU index such as 0; any case)."
    )


def pin_visible_device(
    spec: DeviceSpec, env: MutableMapping[str, str], count: int = 1
) -> DeviceSpec:
    """Restrict the process to the requested GPU(s) before torch is imported.

    ``musa:N`` with ``MUSA_VISIBLE_DEVICES`` unset sets it to ``N`` (``N,N+1`` for
    ``count=2``: the GPUs of a tensor-parallel server); the process then sees them from
    index 0, so the returned spec is ``musa:0``. When the user set the variable already,
    the index keeps its meaning within that list and is not touched.
    """
    var = VISIBLE_DEVICES_VAR.get(spec.type)
    if var is None or spec.index is None or env.get(var, "").strip():
        return spec
    env[var] = ",".join(str(spec.index + i) for i in range(count))
    return DeviceSpec(spec.type, 0)


def run_probe(devices: Sequence[str], env: Mapping[str, str], timeout_s: float) -> dict:
    """Import torch in a child process and report which of ``devices`` is available."""
    try:
        done = subprocess.run(
            [sys.executable, str(PROBE_SCRIPT), *devices],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "timeout": True}
    lines = done.stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        report = {}
    if not isinstance(report, dict) or "ok" not in report:
        # The child died without reporting (e.g. a crash inside a native library).
        last = [ln for ln in done.stderr.strip().splitlines() if ln.strip()][-1:]
        report = {"ok": False, "crashed": done.returncode, "error": " ".join(last)}
    return report


def _device_nodes(patterns: Sequence[str] = MUSA_DEVICE_NODES) -> str:
    """Describe the MUSA device nodes in this container and whether we can open them."""
    nodes = sorted(path for pattern in patterns for path in glob.glob(pattern))
    if not nodes:
        return "no /dev/mtgpu* or /dev/dri/* device nodes exist in this container"
    blocked = [n for n in nodes if not os.access(n, os.R_OK | os.W_OK)]
    if not blocked:
        return f"device nodes present and accessible: {', '.join(nodes)}"
    owners = sorted({os.stat(n).st_gid for n in blocked})
    groups = ", ".join(str(gid) for gid in owners)
    return (
        f"device nodes present but not accessible to uid {os.getuid()} "
        f"(groups {sorted(os.getgroups())}): {', '.join(blocked)}. They belong to group "
        f"id {groups}: add it to the container (compose: HISERVE_DEVICE_GROUP={owners[0]}, "
        "which compose passes to group_add; `getent group render` on the host shows the "
        "render gid), or run as root (HISERVE_USER=root)"
    )


def visible_devices_warning(spec: DeviceSpec, env: Mapping[str, str]) -> str | None:
    """Warn when ``musa:N`` points past the GPUs MTHREADS_VISIBLE_DEVICES gives the container.

    The container toolkit renumbers the GPUs it passes in from 0, so
    ``MTHREADS_VISIBLE_DEVICES=1`` with ``musa:1`` leaves a one-GPU container without GPU 1.
    """
    listed = env.get("MTHREADS_VISIBLE_DEVICES", "").strip().lower()
    if spec.type != "musa" or spec.index is None or listed in ("", "all", "none", "void"):
        return None
    count = len([item for item in listed.split(",") if item.strip()])
    if spec.index < count:
        return None
    return (
        f"MTHREADS_VISIBLE_DEVICES={listed} passes {count} GPU(s) into the container, which "
        f"sees them as musa:0..musa:{count - 1}; musa:{spec.index} is not among them. Pair "
        f"the two: HISERVE_DEVICE=musa:0 with MTHREADS_VISIBLE_DEVICES={listed}, or "
        f"MTHREADS_VISIBLE_DEVICES=all with HISERVE_DEVICE=musa:{spec.index}."
    )


def _musa_failure(info: dict, env: Mapping[str, str]) -> str:
    runtime_hint = (
        "Run the container with the MT container toolkit: runtime 'mthreads' "
        "(`docker info | grep -i mthreads` on the host must list it), "
        "MTHREADS_VISIBLE_DEVICES=all (or GPU indices) and "
        "MTHREADS_DRIVER_CAPABILITIES=compute,utility; check the host driver with "
        "`mthreads-gmi`."
    )
    settings = ", ".join(
        f"{var}={env.get(var, '<unset>')}"
        for var in ("MTHREADS_VISIBLE_DEVICES", "MUSA_VISIBLE_DEVICES")
    )
    if info.get("stage") == "import":
        return (
            f"torch_musa is installed but failed to import ({info.get('error')}). "
            f"This usually means the MUSA driver libraries are missing from the container "
            f"or do not match the image's MUSA SDK. {runtime_hint}"
        )
    if info.get("stage") == "query":
        return (
            f"torch.musa failed while counting GPUs ({info.get('error')}; {_device_nodes()}). "
            f"{runtime_hint}"
        )
    return (
        f"torch_musa {info.get('torch_musa', '')} imported, but torch.musa.is_available() "
        f"is False: no MUSA GPU is visible ({settings}; {_device_nodes()}). {runtime_hint}"
    )


def _cuda_failure(info: dict, env: Mapping[str, str]) -> str:
    if info.get("stage"):
        return f"torch.cuda failed ({info.get('error')})."
    if info.get("cuda") is None and info.get("hip") is None:
        return (
            "this torch build has no CUDA or ROCm support (torch.version.cuda is None): "
            "this image is not a CUDA image. Use HISERVE_DEVICE=cpu, or musa on the MUSA image."
        )
    return (
        "torch.cuda.is_available() is False: no NVIDIA/AMD GPU is visible. Check the host "
        "driver (`nvidia-smi`), run the container with the NVIDIA container toolkit "
        "(`--gpus all`, compose `deploy.resources.reservations.devices`), and "
        f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '<unset>')}, "
        f"HIP_VISIBLE_DEVICES={env.get('HIP_VISIBLE_DEVICES', '<unset>')}."
    )


def _failure_message(
    spec: DeviceSpec, report: dict, env: Mapping[str, str], timeout_s: float, label: str
) -> str:
    head = f"HISERVE_DEVICE={label} cannot be used: "
    if report.get("timeout"):
        return head + (
            f"importing torch and checking the {spec.type} backend did not finish within "
            f"{timeout_s:g} s (HISERVE_PREFLIGHT_TIMEOUT). A hung driver is the usual "
            "cause; check the host driver and the container runtime."
        )
    if "crashed" in report:
        return head + (
            f"the device check crashed (exit code {report['crashed']}): "
            f"{report.get('error') or 'no message'}. Check the driver and container runtime."
        )
    if "torch" not in report:
        return head + f"torch failed to import ({report.get('error')}); the image is broken."
    probe_type = PROBE_TYPE.get(spec.type, spec.type)
    info: dict = next((p for p in report.get("probes", []) if p.get("type") == probe_type), {})
    if spec.type == "musa":
        return head + _musa_failure(info, env)
    if probe_type == "cuda":
        return head + _cuda_failure(info, env)
    detail = info.get("error") or f"torch.{spec.type} reports no available device"
    return head + f"{detail}."


def resolve_device(
    spec: DeviceSpec, env: Mapping[str, str], timeout_s: float, label: str = ""
) -> tuple[DeviceSpec, dict]:
    """Check that ``spec`` is usable (``auto``: pick one); return it and the probe report.

    ``label`` names the device in messages (the user's text when pinning changed it).
    """
    label = label or str(spec)
    if spec.type == "cpu":
        if importlib.util.find_spec("torch") is None:
            raise PreflightError("torch is not installed in this image.", EXIT_NO_DEVICE)
        return spec, {}
    if spec.type == "auto":
        candidates = [
            d
            for d in AUTO_ORDER
            if d not in BACKEND_MODULE or importlib.util.find_spec(BACKEND_MODULE[d])
        ]
        report = run_probe(candidates, env, timeout_s)
        if report.get("ok"):
            return DeviceSpec(str(report["device"])), report
        if "torch" not in report:  # timed out, crashed, or torch itself is broken
            raise PreflightError(
                _failure_message(spec, report, env, timeout_s, label), EXIT_NO_DEVICE
            )
        return DeviceSpec("cpu"), report
    module = BACKEND_MODULE.get(spec.type)
    if module is not None and importlib.util.find_spec(module) is None:
        raise PreflightError(
            f"HISERVE_DEVICE={label} needs {module}, which is not installed in this image. "
            + (
                "This is the wrong image for MUSA: build and run Dockerfile.musa (FROM a "
                "torch_musa release image), or serve on the CPU with HISERVE_DEVICE=cpu "
                "(compose: `docker compose up hiserve-cpu`)."
                if spec.type == "musa"
                else "Use an image that provides it."
            ),
            EXIT_NO_DEVICE,
        )
    report = run_probe([PROBE_TYPE.get(spec.type, spec.type)], env, timeout_s)
    if not report.get("ok"):
        raise PreflightError(_failure_message(spec, report, env, timeout_s, label), EXIT_NO_DEVICE)
    info = report["probes"][-1]
    if spec.index is not None and spec.index >= info.get("count", 0):
        var = VISIBLE_DEVICES_VAR.get(spec.type, "")
        raise PreflightError(
            f"HISERVE_DEVICE={label}: only {info.get('count', 0)} {spec.type} GPU(s) are "
            f"visible ({var}={env.get(var, '<unset>')}). Pick an index below that, or "
            "widen the visible set (MTHREADS_VISIBLE_DEVICES=all for MUSA).",
            EXIT_NO_DEVICE,
        )
    return spec, report
