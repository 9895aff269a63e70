"""Model dtypes: what ``--dtype`` names, and what ``auto`` means on each device."""

from __future__ import annotations

from dataclasses import dataclass

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
    # NOTE: bf16 on CPU only with native bf16 dot products; without AMX/AVX512-BF16 a
    # bf16 matmul is orders of magnitude slower than float32.
    return torch.bfloat16 if cpu_bf16_reason() is not None else torch.float32


def cpu_bf16_reason() -> str | None:
    """Which native bf16 instructions this CPU has (AMX, AVX512-BF16), None if neither."""
    cpu = getattr(torch, "cpu", None)
    found = [
        name
        for name, probe in (
            ("AMX", "_is_amx_tile_supported"),
            ("AVX512-BF16", "_is_avx512_bf16_supported"),
        )
        if callable(getattr(cpu, probe, None)) and getattr(cpu, probe)()
    ]
    return " and ".join(found) if found else None


@dataclass(frozen=True)
class WeightFormat:
    """The model dtype, whether a GGUF's weights stay packed, and why (for the log)."""

    dtype: torch.dtype
    packed_gguf: bool
    reason: str
    # CPU bf16: float32 activations, norms and KV (``dtype``), linear weights rounded to
    # bf16 for the packed-weight kernel (engine/models/bf16_weights.py).
    bf16_weights: bool = False

    @property
    def tag(self) -> str:
        """The weight format in one word (part of the L3 namespace)."""
        if self.packed_gguf:
            return "packed-gguf"
        return "bf16-weights" if self.bf16_weights else "dense"


def choose_weights(name: str, spec: DeviceSpec, gguf: bool, tp_size: int = 1) -> WeightFormat:
    """What ``--dtype name`` means for the weights of a model on ``spec``.

    ``auto`` on the CPU: a GGUF (``gguf``, single process) keeps its blocks packed with
    float32 activations; other models are bf16 where the CPU has native bf16 (AMX,
    AVX512-BF16), float32 elsewhere. An explicit dtype is taken as given (``float32``:
    every weight dense float32, the exact-parity mode). bf16 on the CPU in one process
    means bf16 weights with float32 activations (``bf16_weights``).
    """
    dtype = parse_dtype(name, spec)
    cpu_bf16 = spec.type == "cpu" and dtype == torch.bfloat16 and tp_size == 1
    if name.strip().lower() != "auto":
        if cpu_bf16:
            return WeightFormat(
                torch.float32, False, f"--dtype {name}: bf16 weights, float32 activations", True
            )
        return WeightFormat(dtype, False, f"--dtype {name}")
    if spec.type != "cpu":
        return WeightFormat(dtype, False, f"--dtype auto on {spec.type}")
    if gguf and tp_size == 1:
        return WeightFormat(
            torch.float32,
            True,
            "--dtype auto on a CPU with a GGUF model: its blocks stay packed "
            "(float32 activations); --dtype float32 dequantizes them",
        )
    bf16 = cpu_bf16_reason()
    if bf16 is not None and cpu_bf16:
        return WeightFormat(
            torch.float32,
            False,
            f"--dtype auto on a CPU with {bf16}: bf16 weights, float32 activations",
            True,
        )
    if bf16 is not None:  # tensor parallel: dense bf16 on every rank alike
        return WeightFormat(dtype, False, f"--dtype auto on a CPU with {bf16}: bfloat16")
    return WeightFormat(dtype, False, "--dtype auto on a CPU without AMX or AVX512-BF16: float32")


def kv_cache_dtype(name: str, model_dtype: torch.dtype, spec: DeviceSpec) -> torch.dtype:
    """The KV pool's dtype for ``--kv-cache-dtype name``: ``auto`` is ``model_dtype`` (the
    activations'); float32 or bfloat16 as asked on the CPU, whose attention reads either
    (the K/V are rounded to the pool's dtype as they are stored). On an accelerator the
    attention kernels read the model dtype only, so anything else is refused there."""
    if name == "auto":
        return model_dtype
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(name)
    if dtype is None:
        raise ValueError(
            f"--kv-cache-dtype {name!r} is not valid; choose auto, float32 or bfloat16"
        )
    if spec.type != "cpu" and dtype != model_dtype:
        raise ValueError(
            f"--kv-cache-dtype {name} on {spec.type}: the KV cache there holds the model "
            f"dtype ({str(model_dtype).removeprefix('torch.')}); use auto"
        )
    return dtype


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
