"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

_HAS_RMS_NORM = hasattr(F, "rms_norm")  # torch >= 2.4


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 like the HF reference."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self._shape = (hidden_size,)
        # (x, residual, weight, eps) -> (normed, summed) in one pass; set by
        # fused_cpu.use_fused_cpu_kernels on float32 CPU models, None everywhere else.
        self.fused_add_norm: (
            Callable[
                [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
            ]
            | None
        ) = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_tokens, hidden] -> [num_tokens, hidden]
        if x.dtype == torch.float32 and _HAS_RMS_NORM:
            # One Python-level call instead of six: per-op overhead dominates at decode.
            return F.rms_norm(x, self._shape, self.weight, self.eps)
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance.add_(self.eps))).to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(norm(x + residual), x + residual)``: the pre-norm block pattern."""
        if self.fused_add_norm is not None:
            return self.fused_add_norm(x, residual, self.weight, self.eps)
        summed = x + residual  # [num_tokens, hidden]
        return self.forward(summed), summed

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
