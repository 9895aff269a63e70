"""A minimal greedy generation driver over the paged KV pool, for model tests only.

It plays the model runner's part: owns a DeviceKVPool and a request table, hands out
KV slots, builds AttentionMetadata for (chunked) prefill and batched decode, and takes
the argmax. Slots are handed out in a shuffled order and unused request-table cells hold
other sequences' slots, so attention that ignores the table or the lengths fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.kvcache.device_pool import DeviceKVPool
from engine.layers.attention_meta import AttentionMetadata


@dataclass
class Generation:
    """Greedy output of one prompt: generated token ids and the logits that chose them."""

    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # each [vocab] float32


class GreedyDriver:
    """Runs ``model`` (the engine's LlamaForCausalLM interface) greedily on token prompts."""

    def __init__(
        self,
        model: Any,
        max_rows: int = 8,
        max_context: int = 256,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        cfg = model.config
        self.model = model
        self.device = torch.device(device)
        self.max_rows = max_rows
        self.max_context = max_context
        num_slots = max_rows * max_context + 1  # slot 0 is the dummy
        self.pool = DeviceKVPool(
            num_layers=cfg.num_hidden_layers,
            num_slots=num_slots,
            kv_heads=model.kv_heads,
            head_dim=model.head_dim,
            dtype=dtype,
            device=self.device,
        )
        gen = torch.Generator().manual_seed(seed)
        self._free_slots = (torch.randperm(num_slots - 1, generator=gen) + 1).tolist()
        # Garbage in unused cells: valid slot numbers that belong to nobody in particular.
        self.req_table = torch.randint(
            1, num_slots, (max_rows, max_context), generator=gen, dtype=torch.int32
        ).to(self.device)

    def _meta(
        self,
        is_decode: bool,
        out_slots: list[int],
        rows: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
    ) -> AttentionMetadata:
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        return AttentionMetadata(
            is_decode=is_decode,
            out_slots=torch.tensor(out_slots, dtype=torch.int64, device=self.device),
            req_rows=torch.tensor(rows, dtype=torch.int64, device=self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=self.device),
            req_table=self.req_table,
            prefix_lens_list=prefix_lens,
            extend_lens_list=extend_lens,
            seq_lens_list=seq_lens,
            max_seq_len=max(seq_lens),
            req_rows_list=list(rows),
        )

    def _assign(self, row: int, start: int, count: int) -> list[int]:
        slots = [self._free_slots.pop() for _ in range(count)]
        self.req_table[row, start : start + count] = torch.tensor(slots, dtype=torch.int32)
        return slots

    @torch.inference_mode()
    def _step(
        self,
        is_decode: bool,
        rows: list[int],
        chunks: list[list[int]],
        prefix_lens: list[int],
    ) -> torch.Tensor:
        """Run one forward; return the float32 logits ``[B, vocab]`` of each chunk's last token."""
        out_slots: list[int] = []
        input_ids: list[int] = []
        positions: list[int] = []
        for row, chunk, prefix in zip(rows, chunks, prefix_lens):
            out_slots += self._assign(row, prefix, len(chunk))
            input_ids += chunk
            positions += range(prefix, prefix + len(chunk))
        meta = self._meta(is_decode, out_slots, rows, prefix_lens, [len(c) for c in chunks])
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            meta,
            self.pool,
        )  # [T, hidden]
        last = torch.tensor(meta.extend_lens_list).cumsum(0) - 1  # [B]
        return self.model.compute_logits(hidden[last.to(self.device)]).cpu()

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        prefill_chunk: int | None = None,
        cached_prefix_len: int = 0,
    ) -> list[Generation]:
        """Greedy-decode every prompt together; prefill in chunks of ``prefill_chunk`` tokens.

        ``cached_prefix_len``: the prompts share their first tokens; they are prefilled once
        in a spare row and every prompt's row points at those KV slots (a prefix-cache hit),
        so only the rest of each prompt is computed.
        """
        if len(prompts) + (cached_prefix_len > 0) > self.max_rows:
            raise ValueError("more prompts than request-table rows")
        # Rows in reverse order, so a backend that confuses batch index and row fails.
        rows = [self.max_rows - 1 - i for i in range(len(prompts))]
        results = [Generation() for _ in prompts]
        done = [0] * len(prompts)  # tokens already in the KV pool
        prefix_slots = self._prefill_shared_prefix(prompts, cached_prefix_len)
        for i, row in enumerate(rows):
            self.req_table[row, :cached_prefix_len] = prefix_slots.to(self.req_table.device)
            done[i] = cached_prefix_len
        chunk = prefill_chunk or max(len(p) for p in prompts)
        while any(d < len(p) for d, p in zip(done, prompts)):
            active = [i for i, p in enumerate(prompts) if done[i] < len(p)]
            pieces = [prompts[i][done[i] : done[i] + chunk] for i in active]
            logits = self._step(False, [rows[i] for i in active], pieces, [done[i] for i in active])
            for j, i in enumerate(active):
                done[i] += len(pieces[j])
                if done[i] == len(prompts[i]):
                    results[i].logits.append(logits[j])
                    results[i].tokens.append(int(logits[j].argmax()))
        for _ in range(max_new_tokens - 1):
            last_tokens = [[r.tokens[-1]] for r in results]
            logits = self._step(True, rows, last_tokens, list(done))
            for i, r in enumerate(results):
                done[i] += 1
                r.logits.append(logits[i])
                r.tokens.append(int(logits[i].argmax()))
        # Hand the slots back (the shared prefix once) so the driver can run again.
        self._free_slots += prefix_slots.tolist()
        for i, row in enumerate(rows):
            self._free_slots += self.req_table[row, cached_prefix_len : done[i]].tolist()
        return results

    def _prefill_shared_prefix(self, prompts: list[list[int]], prefix_len: int) -> torch.Tensor:
        """KV slots ``[prefix_len]`` of the prompts' common first ``prefix_len`` tokens."""
        if prefix_len == 0:
            return torch.empty(0, dtype=torch.int32)
        prefix = prompts[0][:prefix_len]
        if any(p[:prefix_len] != prefix or len(p) <= prefix_len for p in prompts):
            raise ValueError("every prompt must extend the shared prefix")
        row = 0  # the prompts use the last rows
        self._step(False, [row], [prefix], [0])
        return self.req_table[row, :prefix_len].clone()

    @torch.inference_mode()
    def prefill_logits(self, prompt: list[int]) -> torch.Tensor:
        """Float32 logits ``[len(prompt), vocab]`` of every prompt position (one extend pass)."""
        row = 0
        slots = self._assign(row, 0, len(prompt))
        meta = self._meta(False, slots, [row], [0], [len(prompt)])
        hidden = self.model(
            torch.tensor(prompt, dtype=torch.int64, device=self.device),
            torch.arange(len(prompt), dtype=torch.int64, device=self.device),
            meta,
            self.pool,
        )
        self._free_slots += slots
        return self.model.compute_logits(hidden).cpu()
