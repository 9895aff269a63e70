"""Fused CPU kernels for the decoder's element-wise work (csrc/fused_ops.h).

RMSNorm with its residual add, RoPE and SwiGLU (``silu(gate) * up``) each take one pass
and one dispatch instead of two or three PyTorch ops; at decode those ops are tiny and
their per-call overhead is most of their cost. Built like the attention kernel (see
``cpu_kernels``): once, on first use, with the machine's C++ compiler. Float32 on the CPU
only; the PyTorch code in rmsnorm.py, rotary.py and linear.py (GatedMLP) stays the
reference and what every other device and dtype runs. Where the build fails,
``fused_kernels()`` is None, the model keeps PyTorch, and the reason is logged once and
kept in ``build_error()``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.layers.cpu_kernels import NativeExtension

logger = logging.getLogger(__name__)

# Set to 0 to keep the PyTorch ops on the CPU too (for comparisons).
ENV_SWITCH = "HISERVE_CPU_FUSED"
_FUSED = NativeExtension(
    "fused_cpu.cpp",
    "hiserve_fused_cpu",
    "fused CPU kernels",
    "RMSNorm, RoPE and SwiGLU run as PyTorch ops. They need a C++ compiler and ninja "
    "(pip install 'hiserve[cpu]').",
    logger,
    avx512=True,  # SwiGLU and the argmax have AVX-512 paths (csrc/vec_math.h)
)


def fused_kernels() -> Any | None:
    """The compiled module (``add_rms_norm``, ``rotary``, ``silu_mul``), or None when it
    cannot be built here."""
    return _FUSED.load()


def build_error() -> str | None:
    """Why the kernels could not be built (None if they were, or were never tried)."""
    return _FUSED.error


def cpu_argmax() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The greedy sampler's argmax (``[B, V]`` float32 -> ``[B]`` int64) for CPU logits,
    or None where the kernels cannot be built or are turned off."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    kernels = fused_kernels()
    return None if kernels is None else kernels.argmax_rows


def use_fused_cpu_kernels(model: nn.Module) -> int:
    """Switch the float32 CPU layers of ``model`` that have a fused kernel to it; returns
    how many layers switched (0 when the kernels cannot be built or are turned off)."""
    from engine.layers.linear import GatedMLP
    from engine.layers.rmsnorm import RMSNorm

    kernels = _FUSED.load_for(model, ENV_SWITCH)
    if kernels is None:
        return 0
    switched = 0
    for module in model.modules():
        # Exact types only: a subclass (Gemma's 1 + weight norm) computes something else.
        if type(module) is RMSNorm:
            module.fused_add_norm = kernels.add_rms_norm
        elif type(module) is GatedMLP and module.activation == "silu":
            module.act_mul = kernels.silu_mul
        elif hasattr(module, "rotary_fn"):
            module.rotary_fn = kernels.rotary
        else:
            continue
        switched += 1
    logger.info("fused CPU kernels in use in %d layers", switched)
    return switched
