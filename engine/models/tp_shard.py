"""Build one tensor-parallel rank's part of a model.

A rank's model is the family's own class built from the rank's share of the config
(``shard_config``: its attention heads, its KV heads, its slice of every MLP and expert),
with the row-parallel layers swapped in (``use_row_parallel``); its weights are the
matching slices of the full checkpoint (``CheckpointSlicer``). Embeddings, norms, routers
and the LM head are replicated: every rank holds them whole.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from engine.layers.linear import ALL_SHARDS, FusedLinear
from engine.layers.moe import SparseMoE
from engine.layers.parallel_linear import (
    RowParallelLinear,
    TPShard,
    even_part,
    kv_head_rows,
    kv_heads_of_rank,
)
from engine.models.llama import head_dim_of

# Modules whose input is split across ranks (their outputs are all-reduced).
ROW_PARALLEL = ("o_proj", "down_proj")
# MLP widths a rank holds a share of, by config field.
_MLP_SIZES = ("intermediate_size", "moe_intermediate_size")


def _divisible(name: str, value: int, size: int) -> int:
    if value % size:
        raise ValueError(
            f"{name}={value} is not divisible by tensor_parallel_size={size}: every rank "
            f"must hold an equal share; use a --tensor-parallel-size that divides {value}"
        )
    return value // size


def shard_config(hf_config: Any, size: int) -> Any:
    """A copy of ``hf_config`` with one rank's share of the heads and MLP widths.

    Raises ValueError naming the numbers when they do not split evenly over ``size`` ranks.
    """
    if size == 1:
        return hf_config
    q_heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or q_heads)
    shard = copy.deepcopy(hf_config)
    shard.head_dim = head_dim_of(hf_config)  # no longer hidden_size // num_attention_heads
    shard.num_attention_heads = _divisible("num_attention_heads", q_heads, size)
    shard.num_key_value_heads = len(kv_heads_of_rank(kv_heads, 0, size))
    for name in _MLP_SIZES:
        value = getattr(hf_config, name, None)
        if value:
            setattr(shard, name, _divisible(name, int(value), size))
    return shard


def use_row_parallel(model: nn.Module, shard: TPShard) -> int:
    """Swap every o_proj/down_proj for a RowParallelLinear of the same shape and make each
    SparseMoE all-reduce its output; returns how many layers now end in an all-reduce.
    Call on the freshly built (meta-device) model, before the weights are loaded."""
    swapped = 0
    for module in list(model.modules()):
        if isinstance(module, SparseMoE):
            module.output_reduce = shard.all_reduce
            swapped += 1
            continue
        for name in ROW_PARALLEL:
            old = getattr(module, name, None)
            if isinstance(old, FusedLinear) and not isinstance(old, RowParallelLinear):
                with torch.device(old.weight.device):
                    new = RowParallelLinear(
                        old.in_features, old.output_sizes, old.bias is not None, shard
                    )
                setattr(module, name, new)
                swapped += 1
    return swapped


class CheckpointSlicer:
    """Cuts each full checkpoint tensor down to what one rank holds.

    Called by ``load_named_weights`` with our parameter name and shard (after the model's
    ``map_name``), before the tensor is copied in.
    """

    def __init__(self, hf_config: Any, shard: TPShard) -> None:
        self.rank, self.size = shard.rank, shard.size
        self.q_heads = int(hf_config.num_attention_heads)
        self.kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or self.q_heads)
        self.head_dim = head_dim_of(hf_config)

    def __call__(self, param_name: str, shard: Any, tensor: torch.Tensor) -> torch.Tensor:
        module, _, kind = param_name.rpartition(".")
        leaf = module.rpartition(".")[2]
        if leaf == "qkv_proj":
            return self._qkv(shard, tensor)
        if leaf == "gate_up_proj":
            return self._halves(tensor, 0) if shard == ALL_SHARDS else self._rows(tensor)
        if leaf in ROW_PARALLEL:
            return self._row_parallel(kind, tensor)
        if kind == "w13":  # experts: [E, 2 * I, hidden] stacked, or one [I, hidden] half
            return self._halves(tensor, 1) if shard == ALL_SHARDS else self._rows(tensor)
        if kind == "w2":  # experts: [E, hidden, I] stacked, or one [hidden, I]
            return even_part(tensor, tensor.dim() - 1, self.rank, self.size)
        return tensor  # replicated: embeddings, norms, routers, LM head

    def _rows(self, tensor: torch.Tensor) -> torch.Tensor:
        return even_part(tensor, 0, self.rank, self.size)

    def _halves(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """A fused gate/up tensor: this rank's part of each half, fused again."""
        gate, up = tensor.chunk(2, dim=dim)
        return torch.cat(
            [even_part(gate, dim, self.rank, self.size), even_part(up, dim, self.rank, self.size)],
            dim=dim,
        )

    def _qkv(self, shard: Any, tensor: torch.Tensor) -> torch.Tensor:
        q_rows = self.q_heads * self.head_dim
        kv_rows = self.kv_heads * self.head_dim
        if shard == ALL_SHARDS:  # Phi-3: q, k and v stored as one tensor
            q, k, v = tensor.split([q_rows, kv_rows, kv_rows], dim=0)
            return torch.cat([self._qkv(0, q), self._qkv(1, k), self._qkv(2, v)], dim=0)
        if shard == 0:
            return self._rows(tensor)
        return kv_head_rows(tensor, self.kv_heads, self.head_dim, self.rank, self.size)

    def _row_parallel(self, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        if kind == "bias":
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        return even_part(tensor, 1, self.rank, self.size)  # [out, in]: split the inputs
