"""Fused CPU kernels for the decoder's element-wise work (csrc/fused_cpu.cpp).

RMSNorm with its residual add, and RoPE, each take one pass and one dispatch instead of
two or three PyTorch ops; at decode those ops are tiny and their per-call overhead is most
of their cost. (SwiGLU was measured and left to PyTorch: see the source.) Built like the
attention kernel (see ``cpu_kernels``): once, on first use, with the machine's C++
compiler. Float32 on the CPU only; the PyTorch code in rmsnorm.py and rotary.py stays the
reference and what every other device and dtype runs. Where the build fails, ``fused_kernels()`` is None, the
model keeps PyTorch, and the reason is logged once and kept in ``build_error()``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.layers.cpu_kernels import _cflags, clear_stale_build_lock

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "fused_cpu.cpp"
# Set to 0 to keep the PyTorch ops on the CPU too (for comparisons).
ENV_SWITCH = "HISERVE_CPU_FUSED"
_lock = threading.Lock()
_module: Any | None = None
_error: str | None = None


def fused_kernels() -> Any | None:
    """The compiled module (``add_rms_norm``, ``rotary``), or None when it
    cannot be built here."""
    global _module, _error
    with _lock:
        if _module is not None or _error is not None:
            return _module
        flags = _cflags()
        # The name carries the source and flags: a changed kernel is never served stale.
        digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()
        name = f"hiserve_fused_cpu_{digest[:12]}"
        try:
            from torch.utils import cpp_extension

            logger.info("loading the fused CPU kernels (built once on first use)")
            clear_stale_build_lock(name)
            _module = cpp_extension.load(
                name=name,
                sources=[str(_SOURCE)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as exc:  # no compiler, no ninja, a failed build: keep PyTorch
            lines = str(exc).strip().splitlines()
            _error = f"{type(exc).__name__}: {lines[-1] if lines else 'no message'}"
            logger.warning(
                "fused CPU kernels unavailable (%s); RMSNorm and RoPE run as PyTorch ops."
                " They need a C++ compiler and ninja (pip install 'hiserve[cpu]').",
                _error,
            )
        return _module


def build_error() -> str | None:
    """Why the kernels could not be built (None if they were, or were never tried)."""
    return _error


def use_fused_cpu_kernels(model: nn.Module) -> int:
    """Switch the float32 CPU layers of ``model`` that have a fused kernel to it; returns
    how many layers switched (0 when the kernels cannot be built or are turned off)."""
    from engine.layers.rmsnorm import RMSNorm

    if os.environ.get(ENV_SWITCH, "1") == "0":
        return 0
    params = list(model.parameters())
    if not params or params[0].device.type != "cpu" or params[0].dtype != torch.float32:
        return 0
    kernels = fused_kernels()
    if kernels is None:
        return 0
    switched = 0
    for module in model.modules():
        # Exact types only: a subclass (Gemma's 1 + weight norm) computes something else.
        if type(module) is RMSNorm:
            module.fused_add_norm = kernels.add_rms_norm
        elif hasattr(module, "rotary_fn"):
            module.rotary_fn = kernels.rotary
        else:
            continue
        switched += 1
    logger.info("fused CPU kernels in use in %d layers", switched)
    return switched
