"""Batch -> input tensors -> model forward -> logits -> sampled tokens."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from engine.grammar import TokenMasker
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.req_table import ReqTable
from engine.layers.attention_meta import AttentionMetadata
from engine.request import Req
from engine.sampler import Sampler, SamplerOutput
from engine.scheduler import ScheduledBatch


class ModelRunner:
    """Runs one scheduled batch through the model and samples one token per finished row.

    The only place above the model where tensors are built; everything it reads from the
    requests is plain Python.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_pool: DeviceKVPool,
        req_table: ReqTable,
        sampler: Sampler,
        device: torch.device,
        eos_token_ids: Collection[int],
    ) -> None:
        self.model: Any = model  # LlamaForCausalLM-like: forward + compute_logits
        self.kv_pool = kv_pool
        self.req_table = req_table
        self.sampler = sampler
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.masker: TokenMasker | None = None  # the engine's, for constrained requests

    def _metadata(self, batch: ScheduledBatch) -> AttentionMetadata:
        seq_lens = [s + n for s, n in zip(batch.starts, batch.extend_lens)]
        device = self.device
        return AttentionMetadata(
            is_decode=batch.is_decode,
            out_slots=batch.out_slots.to(device, non_blocking=True),
            req_rows=torch.tensor([r.row for r in batch.reqs], dtype=torch.int64, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            req_table=self.req_table.table,
            prefix_lens_list=list(batch.starts),
            extend_lens_list=list(batch.extend_lens),
            seq_lens_list=seq_lens,
            max_seq_len=max(seq_lens),
        )

    def _inputs(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor]:
        ids: list[int] = []
        positions: list[int] = []
        for req, start, n in zip(batch.reqs, batch.starts, batch.extend_lens):
            if n == 1:
                ids.append(
                    req.output_ids[-1] if start >= len(req.prompt_ids) else req.prompt_ids[start]
                )
                positions.append(start)
            else:
                ids.extend(req.all_ids[start : start + n])
                positions.extend(range(start, start + n))
        return (
            torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True),
            torch.tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True),
        )

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> SamplerOutput | None:
        """Forward ``batch``; sample for the rows whose prompt is complete."""
        input_ids, positions = self._inputs(batch)
        meta = self._metadata(batch)
        meta.kv_loads = batch.kv_loads
        # Grammar masks are filled on the host before the forward (which a GPU runs
        # asynchronously, so the two overlap there).
        sampling_reqs = [r for r, s in zip(batch.reqs, batch.sample) if s]
        mask = self.masker.fill(sampling_reqs) if self.masker is not None else None
        hidden = self.model(input_ids, positions, meta, self.kv_pool)  # [T, hidden]
        if not any(batch.sample):
            return None
        # Last token of each sequence that samples.
        ends: list[int] = []
        sampling: list[Req] = []
        offset = 0
        for req, n, do_sample in zip(batch.reqs, batch.extend_lens, batch.sample):
            offset += n
            if do_sample:
                ends.append(offset - 1)
                sampling.append(req)
        if len(ends) != hidden.shape[0]:
            hidden = hidden[torch.tensor(ends, dtype=torch.int64, device=self.device)]
        logits = self.model.compute_logits(hidden)  # [num_sampling, vocab] float32
        return self.sampler(logits, sampling, self.eos_token_ids, mask)
