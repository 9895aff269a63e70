"""GGUF block-quantized weights kept packed on the CPU (csrc/quant_cpu.cpp).

A ``QuantTensor`` is one GGUF tensor's bytes, ``[rows, row_bytes]`` uint8, as the file
lays them out: each row a run of ggml blocks. A ``PackedWeight`` is what a ``FusedLinear``
holds instead of a dense weight: row segments (q, k, v; gate, up), each one ggml type,
multiplied by the native kernel that dequantizes in registers and accumulates in float32.
A decode step then reads the packed bytes (4.5-8.5 bits a weight) instead of 32 bits.

Built like the other native kernels (see ``cpu_kernels``): once, on first use. Where it
cannot be built the loader dequantizes the GGUF at load instead, and says so.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from engine.layers.cpu_kernels import NativeExtension

logger = logging.getLogger(__name__)

# ggml type id -> (name, weights per block, bytes per block): the types kept packed.
PACKED_TYPES: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 32, 64),  # plain bfloat16, 32 weights at a time (bf16_weights.py)
}
BF16 = 30
# Set to 0 to dequantize GGUF weights at load as before (for comparisons).
ENV_SWITCH = "HISERVE_GGUF_PACKED"

_QUANT = NativeExtension(
    "quant_cpu.cpp",
    "hiserve_quant_cpu",
    "native CPU kernel for packed GGUF weights",
    "GGUF weights are dequantized at load instead. It needs a C++ compiler and ninja "
    "(pip install 'hiserve[cpu]').",
    logger,
    avx512=True,
)


# Set to 0 to keep batches (more than GEMV_MAX_TOKENS tokens) on the float32 tiles where
# the CPU has AMX (for comparisons; see csrc/quant_amx.h).
AMX_SWITCH = "HISERVE_PACKED_AMX"
_amx_said = False


def quant_kernel() -> Any | None:
    """The compiled module (``qmatmul``, ``dequantize``, ``ISA``, ``AMX``, ``set_amx``),
    or None when it cannot be built here. The first call says which path batches take."""
    global _amx_said
    module = _QUANT.load()
    if module is not None and not _amx_said:
        _amx_said = True
        if module.AMX and os.environ.get(AMX_SWITCH, "1") == "0":
            module.set_amx(False)
            logger.info("packed weights: batches on float32 tiles (%s=0)", AMX_SWITCH)
        elif module.AMX:
            logger.info(
                "packed weights: batches on AMX tiles (float32 sums; GGUF blocks: bf16 hi/lo "
                "split of weights and tokens; bf16 weights: tokens rounded to bf16)"
            )
        else:
            logger.info("packed weights: batches on float32 tiles (no AMX on this CPU)")
    return module


def build_error() -> str | None:
    """Why the kernel could not be built (None if it was, or was never tried)."""
    return _QUANT.error


def type_name(qtype: int) -> str:
    return PACKED_TYPES[qtype][0] if qtype in PACKED_TYPES else f"ggml type {qtype}"


@dataclass(frozen=True)
class QuantTensor:
    """One GGUF tensor kept packed: ``data`` is ``[rows, row_bytes]`` uint8 of ggml blocks
    of type ``qtype`` holding ``cols`` weights per row."""

    qtype: int
    data: torch.Tensor
    cols: int

    def __post_init__(self) -> None:
        _, block, size = PACKED_TYPES[self.qtype]
        if self.cols % block or tuple(self.data.shape[1:]) != (self.cols // block * size,):
            raise ValueError(
                f"{type_name(self.qtype)} data {tuple(self.data.shape)} does not hold "
                f"{self.cols} columns in blocks of {block}"
            )

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def dequantize(self) -> torch.Tensor:
        """``[rows, cols]`` float32."""
        kernel = _require_kernel()
        return kernel.dequantize(self.data, self.qtype, self.cols)


def _require_kernel() -> Any:
    kernel = quant_kernel()
    if kernel is None:
        raise RuntimeError(f"the packed-weight kernel is unavailable: {build_error()}")
    return kernel


class PackedWeight:
    """The packed weight of a ``[out_features, in_features]`` linear layer: row segments,
    each a ``QuantTensor`` (adjacent segments of one type are merged by ``finish``)."""

    def __init__(self, out_features: int, in_features: int) -> None:
        self.out_features = out_features
        self.in_features = in_features
        self._parts: dict[int, QuantTensor] = {}  # first row -> segment
        self._kernel: Any | None = None

    def put(self, start: int, part: QuantTensor) -> None:
        """Rows ``[start, start + part.rows)`` of the weight."""
        if part.cols != self.in_features or start + part.rows > self.out_features:
            raise ValueError(
                f"packed shard {part.shape} at row {start} does not fit a "
                f"[{self.out_features}, {self.in_features}] weight"
            )
        self._parts[start] = part
        self._kernel = None

    @property
    def segments(self) -> list[tuple[int, QuantTensor]]:
        return sorted(self._parts.items(), key=lambda item: item[0])

    def finish(self) -> None:
        """Check every row is covered once and merge adjacent same-type segments (one
        kernel call for q, k and v when they share a type)."""
        merged: list[tuple[int, QuantTensor]] = []
        row = 0
        for start, part in self.segments:
            if start != row:
                raise ValueError(f"packed weight rows {row}..{start} are missing or overlap")
            if merged and merged[-1][1].qtype == part.qtype:
                first, prev = merged[-1]
                data = torch.cat([prev.data, part.data])
                merged[-1] = (first, QuantTensor(part.qtype, data, part.cols))
            else:
                merged.append((start, part))
            row = start + part.rows
        if row != self.out_features:
            raise ValueError(f"packed weight has rows up to {row} of {self.out_features}")
        self._parts = dict(merged)
        self._kernel = _require_kernel()

    @property
    def nbytes(self) -> int:
        return sum(part.data.numel() for part in self._parts.values())

    def type_names(self) -> list[str]:
        return [type_name(part.qtype) for _, part in self.segments]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [T, in] @ W^T (+ bias)`` -> ``[T, out]`` in ``x``'s dtype (float32 inside)."""
        if self._kernel is None:
            self.finish()
        kernel: Any = self._kernel
        x32 = x.float() if x.dtype != torch.float32 else x
        out = torch.empty(x32.shape[0], self.out_features, dtype=torch.float32)
        for start, part in self._parts.items():
            kernel.qmatmul(x32, part.data, part.qtype, out.narrow(1, start, part.rows))
        if bias is not None:
            out += bias
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def _batch_part(self, x: torch.Tensor) -> QuantTensor | None:
        """This weight's one segment where a batch of ``x`` takes the AMX tiles (more
        than GEMV_MAX_TOKENS tokens, AMX on); None otherwise or for several segments."""
        if self._kernel is None:
            self.finish()
        kernel: Any = self._kernel
        if len(self._parts) != 1 or x.shape[0] <= kernel.GEMV_MAX_TOKENS or not kernel.AMX:
            return None
        (part,) = self._parts.values()
        return part

    def swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(x @ gate^T) * (x @ up^T)`` for this ``[gate; up]`` weight, ``[T, out / 2]``
        in ``x``'s dtype, in one pass over the AMX tiles (the ``[T, out]`` product never goes
        to memory); None where that path is not taken (few tokens, no AMX, gate and up of
        two types): the caller multiplies, then applies SwiGLU."""
        part = self._batch_part(x)
        if part is None:
            return None
        x32 = x.float() if x.dtype != torch.float32 else x
        out = torch.empty(x32.shape[0], self.out_features // 2, dtype=torch.float32)
        kernel: Any = self._kernel  # set by _batch_part
        if not kernel.qmatmul_swiglu(x32, part.data, part.qtype, out):
            return None
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def swiglu_down(self, x: torch.Tensor, down: PackedWeight) -> torch.Tensor | None:
        """``down(silu(x @ gate^T) * (x @ up^T))`` for this ``[gate; up]`` weight, ``[T,
        down.out_features]`` in ``x``'s dtype: the SwiGLU result goes from the AMX tiles
        into ``down``'s token tiles (bf16, or high and low bf16 parts, as ``down``'s own
        packing would make them) and never to memory as float32. The same floats as
        ``swiglu`` then ``down.matmul``; None where this pass is not taken (as ``swiglu``,
        or ``down`` of several types)."""
        gate_up, down_part = self._batch_part(x), down._batch_part(x)
        if gate_up is None or down_part is None:
            return None
        x32 = x.float() if x.dtype != torch.float32 else x
        out = torch.empty(x32.shape[0], down.out_features, dtype=torch.float32)
        kernel: Any = self._kernel  # set by _batch_part
        if not kernel.qmatmul_swiglu_down(
            x32, gate_up.data, gate_up.qtype, down_part.data, down_part.qtype, out
        ):
            return None
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def native_linear(self, kernel: Any, bias: torch.Tensor | None) -> Any:
        """This weight (and ``bias``) as the native module's ``PackedLinear``, which
        ``DecodeLayers`` multiplies by as ``matmul`` does (engine/models/native_decode.py)."""
        if self._kernel is None:
            self.finish()
        segments = [(start, part.data, part.qtype) for start, part in self._parts.items()]
        return kernel.PackedLinear(self.out_features, segments, bias)

    def rows_float(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` ([T] int64) dequantized, ``[T, in]`` float32: an embedding lookup."""
        if len(self._parts) != 1:
            raise ValueError("an embedding lookup needs a packed table of one type")
        (part,) = self._parts.values()
        kernel = _require_kernel()
        return kernel.dequantize(part.data.index_select(0, ids), part.qtype, part.cols)

    def dequantize(self) -> torch.Tensor:
        """The whole weight, ``[out, in]`` float32."""
        return torch.cat([part.dequantize() for _, part in self.segments])
