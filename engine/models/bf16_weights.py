"""bfloat16 weights with float32 activations on the CPU (``--dtype bfloat16`` there).

After a float32 load, every linear weight (and the embedding table, a tied model's LM
head) is rounded to bfloat16 and handed to the packed-weight kernel as its ``BF16``
type: a decode step reads 2 bytes a weight instead of 4, and multiplies in float32 by
float32 activations. Norms, residuals, attention and the KV cache stay float32, which
keeps the model's top-1 choices close to float32's (docs/weights.md has the figure);
only the weights' low mantissa bits are dropped.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.layers.linear import FusedLinear
from engine.layers.quant_cpu import BF16, PACKED_TYPES, PackedWeight, QuantTensor, quant_kernel

logger = logging.getLogger(__name__)


def _as_bf16_blocks(weight: torch.Tensor) -> QuantTensor:
    cols = int(weight.shape[1])
    data = weight.detach().to(torch.bfloat16).contiguous().view(torch.uint8)  # [rows, 2 cols]
    return QuantTensor(BF16, data, cols)


def use_bf16_weights(model: nn.Module) -> int:
    """Round ``model``'s linear weights (and embedding table) to bf16, packed for the
    kernel; returns how many layers switched (0 when the kernel cannot be built)."""
    if quant_kernel() is None:
        logger.warning("the packed-weight kernel is unavailable: weights stay float32")
        return 0
    block = PACKED_TYPES[BF16][1]
    switched = 0
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if isinstance(embed, nn.Parameter) and embed.dim() == 2 and embed.shape[1] % block == 0:
        table = PackedWeight(int(embed.shape[0]), int(embed.shape[1]))
        table.put(0, _as_bf16_blocks(embed))
        table.finish()
        model.packed_embedding = table  # type: ignore[assignment]
        model.model.embed_tokens = nn.Parameter(torch.empty(0), requires_grad=False)  # type: ignore[union-attr]
        if getattr(model, "lm_head", False) is None:
            model.lm_head = model.tied_head()  # type: ignore[operator]
        switched += 1
    for module in model.modules():
        if not isinstance(module, FusedLinear) or module.packed is not None:
            continue
        if module.in_features % block or module.weight.dim() != 2:
            continue
        packed = PackedWeight(module.out_features, module.in_features)
        packed.put(0, _as_bf16_blocks(module.weight))
        packed.finish()
        module.packed = packed
        module.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        switched += 1
    logger.info("bf16 weights (float32 activations) in %d layers", switched)
    return switched
