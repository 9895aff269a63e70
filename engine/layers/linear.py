"""Linear layers with fused shards (q/k/v, gate/up), the SwiGLU MLP, and a CPU fast path."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.quant_cpu import PackedWeight, QuantTensor

logger = logging.getLogger(__name__)

# oneDNN picks the packed layout for this batch size; any batch still works. 4 measured
# best overall for decode at batch 1 and 32 (SmolLM2-135M shapes, 2-core x86 CPU).
_PACK_BATCH_HINT = 4
# load_shard's shard index for a checkpoint tensor that holds every shard at once.
ALL_SHARDS = -1
# GatedMLP activations by HF ``hidden_act`` / ``hidden_activation`` name.
_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def _onednn_linear_available() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and ops is not None
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class FusedLinear(nn.Module):
    """``y = x @ W.T + b`` where ``W`` stacks several HF projections row-wise.

    ``output_sizes`` names the shards (e.g. q, k, v); ``load_shard`` copies one HF weight
    into its rows, so one matmul replaces several small ones.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(self.output_sizes)
        self.offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        # torch.empty: the loader overwrites every element, so skip random init.
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        )
        # oneDNN-packed copy of `weight` (CPU only); see pack_for_cpu.
        self._packed: torch.Tensor | None = None
        # The native small-M kernel ``gemv(x, weight, bias)`` and the most rows it takes;
        # set by gemv_cpu.use_cpu_gemv on float32 CPU models, None everywhere else.
        self.gemv: Callable[..., torch.Tensor] | None = None
        self.gemv_max_tokens = 0
        # GGUF blocks kept packed (quant_cpu); set by use_packed, which leaves ``weight``
        # an empty placeholder: the packed bytes are the only copy.
        self.packed: PackedWeight | None = None

    def use_packed(self) -> PackedWeight:
        """Hold the weight as GGUF blocks (filled by ``load_param``) instead of a dense
        tensor; call before the model's memory is allocated, so none is for the weight."""
        self.packed = PackedWeight(self.out_features, self.in_features)
        dense = self.weight
        self.weight = nn.Parameter(
            torch.empty(0, dtype=dense.dtype, device=dense.device), requires_grad=False
        )
        return self.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_tokens, in_features] -> [num_tokens, out_features]
        if self.packed is not None:
            return self.packed.matmul(x, self.bias)
        if self.gemv is not None and x.dim() == 2 and x.shape[0] <= self.gemv_max_tokens:
            # Decode: a few tokens against the whole weight, bound by reading it once.
            return self.gemv(x, self.weight, self.bias)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def shard_keys(self, kind: str) -> list[int]:
        """The shards ``load_shard`` must fill for parameter ``kind`` (weight or bias)."""
        return list(range(len(self.output_sizes)))

    def load_param(self, kind: str, shard: int, weight: torch.Tensor | QuantTensor) -> None:
        """``load_shard`` for parameter ``kind`` (``weight`` or ``bias``): the loader's entry.
        A ``QuantTensor`` goes to the packed weight (``use_packed``), dequantized otherwise."""
        if isinstance(weight, QuantTensor):
            if self.packed is None or kind != "weight":
                weight = weight.dequantize()
            else:
                self.packed.put(0 if shard == ALL_SHARDS else self.offsets[shard], weight)
                return
        self.load_shard(shard, weight, is_bias=kind == "bias")

    def load_shard(self, shard: int, weight: torch.Tensor, is_bias: bool = False) -> None:
        """Copy an HF weight ``[out_i, in]`` (or bias ``[out_i]``) into shard ``shard``;
        ``ALL_SHARDS``: a checkpoint that already stores them fused (Phi-3's qkv_proj)."""
        target = self.bias if is_bias else self.weight
        if target is None:
            raise ValueError("this layer has no bias, but the checkpoint provides one")
        if shard == ALL_SHARDS:
            expected_all = (
                (self.out_features,) if is_bias else (self.out_features, self.in_features)
            )
            if tuple(weight.shape) != expected_all:
                raise ValueError(
                    f"fused checkpoint shape {tuple(weight.shape)} != expected {expected_all}"
                )
            with torch.no_grad():
                target.copy_(weight)
            return
        start, size = self.offsets[shard], self.output_sizes[shard]
        expected = (size,) if is_bias else (size, self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"shard {shard}: checkpoint shape {tuple(weight.shape)} != expected {expected}"
            )
        with torch.no_grad():
            target[start : start + size].copy_(weight)

    def pack_for_cpu(self, second_copy: bool = True) -> bool:
        """Replace the weight by a oneDNN-packed copy (faster GEMV/GEMM on CPU).

        NOTE: afterwards ``weight`` is an empty placeholder and the packed tensor the only
        copy, unless the GEMV kernel uses this layer (``self.gemv``): it reads the dense
        weight, which then stays beside the packed copy, unless ``second_copy`` is False
        (then nothing is packed). Call this after loading, never before ``load_shard``.
        Returns False (and changes nothing) where oneDNN cannot take this weight.
        """
        w = self.weight
        if self.packed is not None or (self.gemv is not None and not second_copy):
            return False
        if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
            return False
        if self._packed is not None:
            return True
        if not _onednn_linear_available():
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_BATCH_HINT)
            probe = torch.zeros(2, self.in_features, dtype=w.dtype)
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, self.bias, "none", [], "")
            if tuple(got.shape) != (2, self.out_features):
                return False
        except (RuntimeError, NotImplementedError) as exc:  # pragma: no cover - build dependent
            logger.info("oneDNN linear unavailable, using F.linear: %s", exc)
            return False
        self._packed = packed
        if self.gemv is None:
            self.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
        return True

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.output_sizes}, bias={self.bias is not None}, "
            f"packed={self._packed is not None}, gemv_max_tokens={self.gemv_max_tokens}"
            + (f", gguf={self.packed.type_names()}" if self.packed is not None else "")
        )


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gate activation called ``name`` in a HF config; a clear error for others."""
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"activation {name!r} is not supported; supported: {', '.join(sorted(_ACTIVATIONS))}"
        )
    return _ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """Gated feed-forward ``down(act(gate(x)) * up(x))`` with gate/up in one matmul
    (SwiGLU with silu; GeGLU for Gemma)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.act = activation_fn(activation)
        # gate_up [T, 2I] -> act(gate) * up [T, I] in one pass; set by
        # fused_cpu.use_fused_cpu_kernels on float32 CPU models (SwiGLU), else None.
        self.act_mul: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.gate_up_proj = FusedLinear(hidden_size, [intermediate_size, intermediate_size], bias)
        self.down_proj = FusedLinear(intermediate_size, [hidden_size], bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = self.intermediate_size
        packed = self.gate_up_proj.packed
        if self.act_mul is not None and packed is not None and self.gate_up_proj.bias is None:
            # SwiGLU in the packed product's own pass where it can (AMX batches).
            # NOTE: apart, the [T, 2I] product was the largest tensor a prefill wrote and
            # read back (2026-12-06).
            down = self.down_proj
            # Its result straight into the down product's tiles, where that is a plain
            # packed layer (a row-parallel one reduces its output in forward).
            if type(down) is FusedLinear and down.packed is not None and down.bias is None:
                out = packed.swiglu_down(x, down.packed)
                if out is not None:
                    return out
            fused = packed.swiglu(x)
            if fused is not None:
                return self.down_proj.forward(fused)
        gate_up = self.gate_up_proj.forward(x)  # [num_tokens, 2 * intermediate]
        if self.act_mul is not None:
            return self.down_proj.forward(self.act_mul(gate_up))
        # [num_tokens, intermediate] -> [num_tokens, hidden]
        return self.down_proj.forward(self.act(gate_up[:, :size]) * gate_up[:, size:])
