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

    A mixed batch puts its ``num_decodes`` decode sequences (one new token each) first and
    its prefill chunks after them, so attention can run the two parts its own way.
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
    # Mixed batches: sequences [0, num_decodes) are decodes, the rest extends (ignored
    # when is_decode, where every sequence is a decode).
    num_decodes: int = 0
    # Filled lazily by the attention backend once per forward, reused by every layer.
    cache: dict[str, torch.Tensor] = field(default_factory=dict)
    _parts: tuple[AttentionMetadata, AttentionMetadata] | None = field(
        default=None, init=False, repr=False
    )

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.out_slots.shape[0])

    def split_decodes(self) -> tuple[AttentionMetadata, AttentionMetadata]:
        """The decode part (the first ``num_decodes`` sequences and tokens) and the extend
        part of a mixed batch, each with its own cache; built once, reused by every layer.

        NOTE: the parts carry no ``kv_loads``: the whole batch's forward waits for each
        layer's host-tier copies before either part reads the pool.
        """
        if self._parts is None:
            d = self.num_decodes
            assert 0 < d < self.batch_size, "split_decodes needs decodes and extends"
            rows = self.req_rows_list

            def part(lo: int, hi: int, tok_lo: int, tok_hi: int) -> AttentionMetadata:
                seq_lens = self.seq_lens_list[lo:hi]
                return AttentionMetadata(
                    is_decode=lo == 0,
                    out_slots=self.out_slots[tok_lo:tok_hi],
                    req_rows=self.req_rows[lo:hi],
                    seq_lens=self.seq_lens[lo:hi],
                    req_table=self.req_table,
                    prefix_lens_list=self.prefix_lens_list[lo:hi],
                    extend_lens_list=self.extend_lens_list[lo:hi],
                    seq_lens_list=seq_lens,
                    max_seq_len=max(seq_lens),
                    req_rows_list=rows[lo:hi] if rows else [],
                )

            self._parts = (
                part(0, d, 0, d),
                part(d, self.batch_size, d, self.num_tokens),
            )
        return self._parts
