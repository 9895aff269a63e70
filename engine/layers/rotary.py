"""Rotary position embedding (RoPE) with the ``default``, ``linear`` and ``llama3`` variants."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class RopeParams(NamedTuple):
    """RoPE settings read from a HF config (transformers 4.x or 5.x layout)."""

    rope_type: str
    theta: float
    scaling: dict[str, Any]  # the remaining keys, e.g. factor, low_freq_factor


def read_rope_params(hf_config: Any) -> RopeParams:
    """Normalise ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (4.x)."""
    params = getattr(hf_config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        params = getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = getattr(hf_config, "rope_theta", None) or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial not in (None, 1.0):
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"RoPE type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeParams(rope_type=rope_type, theta=float(theta), scaling=params)


def compute_inv_freq(rope: RopeParams, head_dim: int) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` in float32 on the CPU."""
    # Explicitly on the CPU: the model may be built under a `torch.device("meta")` context.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)  # [head_dim // 2]
    if rope.rope_type == "linear":
        inv_freq = inv_freq / float(rope.scaling["factor"])
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope.scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band
    # in between interpolated smoothly.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin once per forward from token positions; layers apply them to q and k."""

    def __init__(self, head_dim: int, rope: RopeParams) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        # NOTE: a plain attribute, not a buffer: it must stay float32 when the model is
        # cast to half, and survive building the model on the meta device.
        self._inv_freq = compute_inv_freq(rope, head_dim)  # [head_dim // 2] float32

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``cos, sin`` ``[T, 1, head_dim]``; ``sin`` carries the rotate-half sign."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]  # [T, head_dim // 2]
        cos_half, sin_half = freqs.cos(), freqs.sin()
        cos = torch.cat((cos_half, cos_half), dim=-1)  # [T, head_dim]
        sin = torch.cat((-sin_half, sin_half), dim=-1)  # [T, head_dim]
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` (NeoX half-split layout, as HF Llama)."""
    # roll by half swaps the halves: [x2, x1]; the sign of rotate_half lives in `sin`.
    swapped = torch.roll(x, shifts=x.shape[-1] // 2, dims=-1)  # [T, heads, head_dim]
    return torch.addcmul(x * cos, swapped, sin)  # x * cos + swapped * sin
