"""Model dtypes: what ``--dtype`` names, and what ``auto`` means on each device."""

from __future__ import annotations

import torch

from engine.platform import DeviceSpec, backend_module

_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
# MUSA compute capability of the first bf16-capable generation (S4000, QY2 = mp_22);
# S80/S3000 report (2, 1), S5000 (3, 1).
_MUSA_BF16_CAPABILITY = (2, 2)


def default_dtype(spec: DeviceSpec) -> torch.dtype:
    """The model dtype that ``auto`` means on ``spec``."""
    kind = "cuda" if spec.type == "hip" else spec.type
    if kind == "cuda":
        try:
            supported = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # torch < 2.3 has no including_emulation
            supported = torch.cuda.is_bf16_supported()
        return torch.bfloat16 if supported else torch.float16
    if kind == "musa":
        module = backend_module("musa")
        try:
            capability = tuple(module.get_device_capability(spec.index)) if module else (0, 0)
        except Exception:
            capability = (0, 0)
        return torch.bfloat16 if capability >= _MUSA_BF16_CAPABILITY else torch.float16
    if kind in ("npu", "xpu"):
        return torch.bfloat16
    if kind == "mps":
        return torch.float16
    # NOTE: fp32 on CPU: bf16 matmul is orders of magnitude slower without AMX/AVX512-BF16.
    return torch.float32


def parse_dtype(name: str, spec: DeviceSpec) -> torch.dtype:
    key = name.strip().lower()
    if key == "auto":
        return default_dtype(spec)
    if key not in _DTYPE_NAMES:
        raise ValueError(
            f"dtype {name!r} is not valid; choose auto, float32, float16 or "
            "bfloat16 (or fp32, fp16, bf16)"
        )
    return _DTYPE_NAMES[key]
