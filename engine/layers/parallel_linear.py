"""Tensor-parallel linear layers and the slices of a checkpoint tensor each rank holds.

Column-parallel layers (q/k/v, gate/up, expert w1/w3) are plain ``FusedLinear`` layers
built with a rank's share of the output rows: their outputs need no communication.
Row-parallel layers (o_proj, down_proj; expert w2 inside SparseMoE) take a rank's share of
the input columns, so each rank computes a partial sum and one all-reduce adds them up.

NOTE: with one rank nothing here is used: the model is built exactly as before, with no
collective and no extra call in the forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.layers.linear import FusedLinear


@dataclass(frozen=True)
class TPShard:
    """This process's place in the tensor-parallel group: ``rank`` of ``size``."""

    rank: int
    size: int
    group: Any = None  # the torch.distributed group of the forward; None: the default one

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        dist.all_reduce(x, group=self.group)
        return x


class RowParallelLinear(FusedLinear):
    """``y = sum_r x_r @ W_r.T (+ b)``: each rank holds columns ``W_r`` of the weight and
    the matching slice ``x_r`` of the input; the all-reduce adds the partial sums.

    NOTE: the bias is added once: rank 0 loads it, the other ranks hold zeros
    (``shard_tensor`` does this), so the sum carries it exactly once.
    """

    def __init__(
        self, in_features: int, output_sizes: Sequence[int], bias: bool, shard: TPShard
    ) -> None:
        super().__init__(in_features, output_sizes, bias)
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_tokens, in_features / tp] -> [num_tokens, out_features], summed over ranks
        return self.shard.all_reduce(super().forward(x))


def even_part(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Part ``rank`` of ``size`` equal parts of ``tensor`` along ``dim``."""
    length = tensor.shape[dim]
    if length % size:
        raise ValueError(
            f"cannot split a dimension of {length} into {size} equal tensor-parallel parts; "
            f"use a --tensor-parallel-size that divides {length}"
        )
    part = length // size
    return tensor.narrow(dim, rank * part, part)


def kv_heads_of_rank(kv_heads: int, rank: int, size: int) -> range:
    """The KV heads rank ``rank`` holds: an equal share when there are at least as many
    heads as ranks; else one head, replicated on ``size // kv_heads`` ranks (as vLLM does)."""
    if kv_heads >= size:
        if kv_heads % size:
            raise ValueError(
                f"num_key_value_heads={kv_heads} is not divisible by "
                f"tensor_parallel_size={size}; use a --tensor-parallel-size that divides it"
            )
        per_rank = kv_heads // size
        return range(rank * per_rank, (rank + 1) * per_rank)
    if size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={size} is not a multiple of num_key_value_heads="
            f"{kv_heads}: with fewer KV heads than ranks each head is replicated on an equal "
            "number of ranks; use a --tensor-parallel-size that is a multiple of it"
        )
    head = rank // (size // kv_heads)
    return range(head, head + 1)


def kv_head_rows(
    tensor: torch.Tensor, kv_heads: int, head_dim: int, rank: int, size: int
) -> torch.Tensor:
    """The rows (dim 0) of a k or v projection ``[kv_heads * head_dim, ...]`` for ``rank``."""
    heads = kv_heads_of_rank(kv_heads, rank, size)
    return tensor.narrow(0, heads.start * head_dim, len(heads) * head_dim)
