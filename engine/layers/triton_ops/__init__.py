"""Triton kernels: one source for CUDA, ROCm and MUSA (torch_musa's Triton backend).

Kernel modules are imported lazily (only where a Triton backend is chosen), so the engine
runs without the ``triton`` package. CPU CI runs the same kernels under Triton's
interpreter (``TRITON_INTERPRET=1`` before the kernel module is imported).
"""

from __future__ import annotations

import importlib.util
import os

import torch

# Device types whose torch tensors a Triton GPU backend can take (ROCm reports "cuda").
TRITON_DEVICE_TYPES = ("cuda", "hip", "musa")


def interpreting() -> bool:
    """Whether Triton kernels run under the interpreter (numpy on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device`` (None: they can).

    On a GPU this asks Triton's active driver, which raises where no backend matches the
    device (e.g. a CUDA triton next to torch_musa).
    """
    if interpreting():
        return None if device.type == "cpu" else f"the Triton interpreter cannot run on {device}"
    if device.type not in TRITON_DEVICE_TYPES:
        return f"no Triton GPU backend for device type {device.type!r}"
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install 'hiserve[kernels]')"
    try:
        import triton

        target = triton.runtime.driver.active.get_current_target()
    except Exception as exc:  # any driver problem means: no kernels here
        return f"triton has no working backend: {type(exc).__name__}: {exc}"
    if target is None:
        return "triton reports no current target"
    return None


# Set to 0 to keep the PyTorch element-wise ops on GPUs too (for comparisons).
FUSED_ENV_SWITCH = "HISERVE_TRITON_FUSED"


def use_fused_ops(model: torch.nn.Module, device: torch.device) -> int:
    """Switch ``model``'s RMSNorm, SwiGLU and RoPE to the fused Triton kernels on a GPU
    where Triton runs; how many layers switched (0 on the CPU, which has its own)."""
    if device.type not in TRITON_DEVICE_TYPES or os.environ.get(FUSED_ENV_SWITCH) == "0":
        return 0
    if unavailable_reason(device) is not None:
        return 0  # the attention backend choice logs why
    from engine.layers.triton_ops.fused import use_triton_fused_ops

    return use_triton_fused_ops(model)
