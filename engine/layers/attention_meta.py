"""What one forward pass tells attention about the batch (built by the model runner)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Layout of a flattened batch of B sequences and T new tokens.

    The new tokens of sequence b are ``input_ids[cu_extend[b]:cu_extend[b+1]]``; they sit
    at positions ``prefix_lens[b] .. seq_lens[b]-1`` of that sequence. The KV of the whole
    sequence lives at slots ``req_table[req_rows[b], :seq_lens[b]]`` after this pass
    writes the new tokens' K/V to ``out_slots``.
    """

    is_decode: bool  # every sequence has exactly one new token
    out_slots: torch.Tensor  # [T] int64: KV slot of each new token
    req_rows: torch.Tensor  # [B] int64: request-table row of each sequence
    seq_lens: torch.Tensor  # [B] int64: context length including the new tokens
    req_table: torch.Tensor  # [max_running_requests, max_context] int32 (shared)
    prefix_lens_list: list[int]  # [B] tokens already in the KV pool before this pass
    extend_lens_list: list[int]  # [B] new tokens per sequence; sums to T
    seq_lens_list: list[int]  # [B]
    max_seq_len: int
    # [B] req_rows as Python ints: a row picked by a 0-dim device tensor syncs the host.
    req_rows_list: list[int] = field(default_factory=list)
    # Host-tier loads (TransferHandle) still in flight: each layer waits for its part.
    kv_loads: list[Any] = field(default_factory=list)
    # Filled lazily by the attention backend once per forward, reused by every layer.
    cache: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.out_slots.shape[0])
