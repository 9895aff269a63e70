"""Batch -> input tensors -> model forward -> logits -> sampled tokens."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

from engine.future_tokens import FutureTokens
from engine.grammar import TokenMasker
from engine.graph_runner import DecodeGraphRunner
from engine.host_alloc import staging_empty
from engine.kvcache.device_pool import DeviceKVPool
from engine.kvcache.req_table import ReqTable
from engine.layers.attention_meta import AttentionMetadata
from engine.mixed_graphs import MixedGraphRunner
from engine.prompt_scoring import score_prompts, scoring_rows
from engine.request import Req
from engine.sampler import Sampler, SamplerOutput
from engine.scheduled_batch import ScheduledBatch


@dataclass
class StepInputs:
    """What one forward reads, as plain Python (rank 0 sends it to the other TP ranks)."""

    is_decode: bool  # every sequence decodes one token
    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    out_slots: torch.Tensor  # [T] int64 on the CPU: KV slot of each new token
    req_rows: list[int]  # [B] request-table rows
    prefix_lens: list[int]  # [B] tokens already in the KV pool
    extend_lens: list[int]  # [B] new tokens per sequence
    sample_ends: list[int]  # index of each sampling sequence's last token
    num_decodes: int = 0  # a mixed batch: its first num_decodes sequences decode
    future_refs: bool = False  # input_ids holds references to tokens still on the device
    # Replayed from the graph of its batch size (decode) or token count (steps that
    # prefill), decided by rank 0 for every tensor-parallel rank: a graph's rows are
    # padded, so all must take the same path.
    replay: bool = False


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
        masker: TokenMasker | None = None,
        graphs: DecodeGraphRunner | None = None,
        on_step: Callable[[StepInputs | None], None] | None = None,
        futures: FutureTokens | None = None,
        mixed_graphs: MixedGraphRunner | None = None,
    ) -> None:
        self.model: Any = model  # LlamaForCausalLM-like: forward + compute_logits
        self.kv_pool = kv_pool
        self.req_table = req_table
        self.sampler = sampler
        self.vocab_size: int = sampler.vocab_size  # prompt scoring slices logits to it
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.masker = masker  # the engine's, for constrained requests
        # Tensor parallel (rank 0): hands each step's inputs to the other ranks.
        self.on_step = on_step
        # Device graphs for pure decode steps (engine/graph_runner.py); None: all eager.
        self.graphs = graphs
        # Device graphs for steps that prefill (engine/mixed_graphs.py); None: eager.
        self.mixed_graphs = mixed_graphs
        # Sampled tokens not yet on the host, for the overlapped loop (future_tokens.py).
        self.futures = futures

    def _upload(self, parts: list[torch.Tensor | list[int]]) -> list[torch.Tensor]:
        """Every int64 input of one step in one buffer, one host -> device copy. A tensor
        among ``parts`` is on the CPU (read here without waiting for the device).

        NOTE: ``torch.tensor(list, device=...)`` or a blocking ``.to()`` from pageable
        memory waits for everything queued on the stream; here the buffer is pinned (on
        accelerators) and the copy asynchronous, so the host runs ahead of the device.
        """
        sizes = [len(p) if isinstance(p, list) else p.numel() for p in parts]
        values: list[int] = []
        for part in parts:  # one Python list, one tensor: torch calls cost more than ints
            values.extend(part if isinstance(part, list) else part.tolist())
        host = torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cpu":
            staged = staging_empty(len(values), torch.int64, self.device)
            host = staged.copy_(host)
        return list(host.to(self.device, non_blocking=True).split(sizes))

    def _host_inputs(self, batch: ScheduledBatch) -> tuple[list[int], list[int], bool]:
        """Input ids and positions; a token still on the device goes in as a reference
        (FutureTokens.ref). Also whether any did."""
        ids: list[int] = []
        positions: list[int] = []
        refs = False
        for req, start, n in zip(batch.reqs, batch.starts, batch.extend_lens):
            if n == 1:
                known = len(req.prompt_ids) + len(req.output_ids)
                if start >= known:  # only a decode's input can be in flight
                    ids.append(FutureTokens.ref(req.future_ids[start - known]))
                    refs = True
                elif start >= len(req.prompt_ids):
                    ids.append(req.output_ids[start - len(req.prompt_ids)])
                else:
                    ids.append(req.prompt_ids[start])
                positions.append(start)
            else:
                ids.extend(req.all_ids[start : start + n])
                positions.extend(range(start, start + n))
        return ids, positions, refs

    @staticmethod
    def _sample_ends(batch: ScheduledBatch) -> tuple[list[int], list[Req]]:
        """Index of the last token of each sequence that samples, and its request."""
        if batch.is_decode and all(batch.sample):  # one token each, every one samples
            return list(range(len(batch.reqs))), list(batch.reqs)
        ends: list[int] = []
        sampling: list[Req] = []
        offset = 0
        for req, n, do_sample in zip(batch.reqs, batch.extend_lens, batch.sample):
            offset += n
            if do_sample:
                ends.append(offset - 1)
                sampling.append(req)
        return ends, sampling

    def step_inputs(self, batch: ScheduledBatch) -> tuple[StepInputs, list[Req]]:
        """The forward's inputs as plain Python, and the requests that sample after it."""
        ids, positions, refs = self._host_inputs(batch)
        ends, sampling = self._sample_ends(batch)
        inputs = StepInputs(
            is_decode=batch.is_decode,
            num_decodes=batch.num_decodes,
            input_ids=ids,
            positions=positions,
            out_slots=batch.out_slots,
            req_rows=[r.row for r in batch.reqs],
            prefix_lens=list(batch.starts),
            extend_lens=list(batch.extend_lens),
            sample_ends=ends,
            future_refs=refs,
        )
        return inputs, sampling

    def forward(self, inputs: StepInputs, kv_loads: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the model on ``inputs``: hidden states ``[T, hidden]`` and the sampling rows'
        indices ``[num_sampling]`` into them. Every tensor-parallel rank runs this."""
        rows = inputs.req_rows
        seq_lens = [s + n for s, n in zip(inputs.prefix_lens, inputs.extend_lens)]
        input_ids, positions_t, out_slots, req_rows, seq_lens_t, ends_t = self._upload(
            [
                inputs.input_ids,
                inputs.positions,
                inputs.out_slots,
                rows,
                seq_lens,
                inputs.sample_ends,
            ]
        )
        if inputs.future_refs:
            self._futures().resolve(input_ids)
        meta = AttentionMetadata(
            is_decode=inputs.is_decode,
            num_decodes=inputs.num_decodes,
            out_slots=out_slots,
            req_rows=req_rows,
            seq_lens=seq_lens_t,
            req_table=self.req_table.table,
            prefix_lens_list=inputs.prefix_lens,
            extend_lens_list=inputs.extend_lens,
            seq_lens_list=seq_lens,
            max_seq_len=max(seq_lens),
            req_rows_list=rows,
            kv_loads=kv_loads,
        )
        return self.model(input_ids, positions_t, meta, self.kv_pool), ends_t

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> SamplerOutput | None:
        """Forward ``batch``; sample for the rows whose prompt is complete. The tokens
        may still be on their way to the host (``SamplerOutput.token_ids`` waits)."""
        self.req_table.flush()  # this step's table writes, before attention reads them
        inputs, sampling = self.step_inputs(batch)
        # NOTE: the step is complete (inputs, grammar masks) before it goes to the other
        # tensor-parallel ranks: a failure while filling it must not leave them inside the
        # forward's all-reduce waiting for a rank 0 that never joins. Masks are filled on
        # the host before the forward (which a GPU runs asynchronously, so they overlap).
        mask = self.masker.fill(sampling) if self.masker is not None and sampling else None
        # A step that scores its prompt reads every token's hidden state: never replayed.
        scores = self.mixed_graphs is not None and not batch.is_decode and bool(scoring_rows(batch))
        inputs.replay = self._replays(inputs, bool(batch.kv_loads) or scores)
        if self.on_step is not None:
            self.on_step(inputs)  # tensor parallel: the other ranks run the same forward
        logits = self._replay(inputs) if inputs.replay else None  # [B, vocab] or None
        if logits is not None:
            return self._sample(logits, sampling, mask) if sampling else None
        hidden, ends_t = self.forward(inputs, batch.kv_loads)  # [T, hidden]
        if not inputs.is_decode:
            score_prompts(hidden, batch, self.model.compute_logits, self.vocab_size)
        if not sampling:
            return None
        if len(sampling) != hidden.shape[0]:
            hidden = hidden.index_select(0, ends_t)  # [num_sampling, hidden]
        logits = self.model.compute_logits(hidden)  # [num_sampling, vocab] float32
        return self._sample(logits, sampling, mask)

    def _sample(self, logits: torch.Tensor, sampling: list[Req], mask: Any) -> SamplerOutput:
        out = self.sampler(logits, sampling, self.eos_token_ids, mask)
        out.start_download()  # the host reads the tokens when it needs them
        return out

    def _futures(self) -> FutureTokens:
        assert self.futures is not None, "a reference to a future token needs the buffer"
        return self.futures

    def _replays(self, inputs: StepInputs, eager_only: bool) -> bool:
        """Whether the step of ``inputs`` replays a graph: pure decode steps (every row
        samples) that fit a batch bucket, and steps that prefill that fit a token bucket;
        never a step that waits for a host-tier load or scores its prompt
        (``eager_only``)."""
        if eager_only:
            return False
        if not inputs.is_decode:
            mixed = self.mixed_graphs
            count = len(inputs.input_ids)
            return mixed is not None and mixed.bucket_of(count, len(inputs.req_rows)) is not None
        graphs = self.graphs
        if graphs is None or len(inputs.sample_ends) != len(inputs.req_rows):
            return False
        return graphs.can_run([s + 1 for s in inputs.prefix_lens])

    def _replay(self, inputs: StepInputs) -> torch.Tensor | None:
        """Logits of the sampling rows of the step replayed from its graph (valid until
        the next replay); None where the graph could not be captured: run it eagerly."""
        resolve = self._futures().resolve if inputs.future_refs else None
        if not inputs.is_decode:
            assert self.mixed_graphs is not None, "only a runner with mixed graphs replays"
            return self.mixed_graphs.run(
                inputs.input_ids,
                inputs.positions,
                inputs.out_slots,
                inputs.req_rows,
                inputs.prefix_lens,
                inputs.extend_lens,
                inputs.sample_ends,
                resolve=resolve,
            )
        assert self.graphs is not None, "only a runner with graphs replays"
        return self.graphs.run(
            inputs.input_ids,
            inputs.positions,
            inputs.out_slots,
            inputs.req_rows,
            [s + 1 for s in inputs.prefix_lens],  # [B] the new token included
            resolve=resolve,
        )

    def follow(self, inputs: StepInputs, kv_loads: list[Any]) -> None:
        """A tensor-parallel worker's step: rank 0's forward, replayed from this rank's
        graph where rank 0 replays its own (the graphs were captured in lockstep,
        engine/graph_setup.py), else eager; the logits are rank 0's to use."""
        if not inputs.replay:
            self.forward(inputs, kv_loads)
            return
        # NOTE: a padded graph and an eager forward all-reduce tensors of different
        # shapes; a rank that cannot follow must fail, not run the other path.
        if inputs.is_decode:
            seq_lens = [s + 1 for s in inputs.prefix_lens]
            can = self.graphs is not None and self.graphs.can_run(seq_lens)
            what = f"a decode graph of {len(seq_lens)} rows"
        else:
            mixed = self.mixed_graphs
            count = len(inputs.input_ids)
            can = mixed is not None and mixed.bucket_of(count, len(inputs.req_rows)) is not None
            what = f"a mixed graph of {count} tokens"
        if not can or self._replay(inputs) is None:
            raise RuntimeError(f"rank 0 replayed {what} that this rank cannot replay")
