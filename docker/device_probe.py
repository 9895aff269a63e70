"""Child-process device check: ``python device_probe.py musa`` prints one JSON line.

Run by the entrypoint's preflight in a fresh process (with a timeout) so that torch is
imported only after ``MUSA_VISIBLE_DEVICES`` is set, and so that a hung or crashing
driver cannot take the entrypoint down with it. Never lets an exception escape: the
operator sees a message built from the report, not a traceback.

NOTE: torch >= 2.5 imports torch_musa (>= 2.1) inside ``import torch`` through its
``torch.backends`` entry point. A missing or mismatched MUSA driver would then fail
``import torch`` itself and look like a broken image. The probe turns that autoload off
and imports torch_musa on its own, so a driver problem is reported as one.

Report: {"ok": bool, "device": first available type or None, "torch": version,
         "probes": [{"type", "available", "count", "names", "torch_musa", "cuda",
                     "hip", "stage", "error"}, ...], "error": why torch failed}
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def probe(torch: Any, device_type: str) -> dict[str, Any]:
    """Import the backend module for ``device_type`` and ask torch what it can see."""
    info: dict[str, Any] = {"type": device_type}
    try:
        if device_type == "musa":
            import torch_musa

            info["torch_musa"] = getattr(torch_musa, "__version__", "unknown")
        elif device_type == "npu":
            import torch_npu

            info["torch_npu"] = getattr(torch_npu, "__version__", "unknown")
    except Exception as exc:
        info.update(stage="import", error=f"{type(exc).__name__}: {exc}")
        return info
    try:
        if device_type == "cuda":
            info["cuda"] = getattr(torch.version, "cuda", None)
            info["hip"] = getattr(torch.version, "hip", None)
        if device_type == "mps":
            available = bool(torch.backends.mps.is_available())
            count = 1 if available else 0
        else:
            backend = getattr(torch, device_type, None)
            if backend is None:
                info.update(stage="import", error=f"this torch has no torch.{device_type}")
                return info
            available = bool(backend.is_available())
            count = int(backend.device_count()) if available else 0
            if available and hasattr(backend, "get_device_name"):
                info["names"] = [str(backend.get_device_name(i)) for i in range(count)]
    except Exception as exc:
        info.update(stage="query", error=f"{type(exc).__name__}: {exc}")
        return info
    info.update(available=available, count=count)
    return info


def main(device_types: list[str]) -> dict[str, Any]:
    """Probe ``device_types`` in order and stop at the first available one."""
    report: dict[str, Any] = {"ok": False, "device": None, "probes": []}
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # before torch's first import
    try:
        import torch

        report["torch"] = str(torch.__version__)
        for device_type in device_types:
            info = probe(torch, device_type)
            report["probes"].append(info)
            if info.get("available"):
                report.update(ok=True, device=device_type)
                break
    except BaseException as exc:  # NOTE: report everything, even SystemExit from a plugin
        report["error"] = f"{type(exc).__name__}: {exc}"
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])), flush=True)
