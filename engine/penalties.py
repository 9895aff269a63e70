"""Logit penalties: repetition (HF), presence and frequency (OpenAI), the min_tokens ban."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Collection, Sequence

import torch

from engine.request import Req, SamplingParams


def upload(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A Python list on ``device`` without a stream sync: ``torch.tensor(..., device=)``
    waits for all queued work; a non-blocking copy of a small host tensor does not."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def min_tokens_banned(
    params: SamplingParams, num_output: int, eos_token_ids: Collection[int]
) -> list[int]:
    """Token ids that may not be sampled yet because ``min_tokens`` is not reached."""
    if num_output >= params.min_tokens:
        return []
    banned = params.stop_token_ids
    if not params.ignore_eos:
        banned = banned.union(eos_token_ids)
    return sorted(banned)


class Penalties:
    """Applies each row's penalties to a logits batch; never modifies its input.

    Keeps each request's prompt ids on the device (prompts never change once queued).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._prompt_tensors: weakref.WeakKeyDictionary[Req, torch.Tensor] = (
            weakref.WeakKeyDictionary()
        )

    def apply(self, logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
        """Return logits with repetition (HF) and presence/frequency (OpenAI) penalties.

        Repetition penalty covers prompt and output tokens: a positive logit is divided
        by the penalty, a negative one multiplied. Presence and frequency penalties cover
        output tokens only: ``logit -= presence * (count > 0) + frequency * count``.
        The input is not modified.
        """
        rep_rows = [b for b, r in enumerate(reqs) if r.params.repetition_penalty != 1.0]
        freq_rows = [
            b
            for b, r in enumerate(reqs)
            if r.output_ids
            and (r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0)
        ]
        if not rep_rows and not freq_rows:
            return logits
        logits = logits.clone()  # [B, V]
        device = logits.device
        # NOTE: the updates below touch only the (row, token) pairs that occurred, O(N),
        # never a [B, V] temporary. A pair listed twice writes the same value twice.
        if rep_rows:
            rows, token_ids = self._flat_token_ids(reqs, rep_rows, with_prompt=True)  # [N]
            penalty = upload([reqs[b].params.repetition_penalty for b in range(len(reqs))], device)[
                rows
            ]  # [N]
            values = logits[rows, token_ids]  # [N]
            logits[rows, token_ids] = torch.where(values > 0, values / penalty, values * penalty)
        if freq_rows:
            rows, token_ids = self._flat_token_ids(reqs, freq_rows, with_prompt=False)  # [N]
            coef = upload(
                [[r.params.presence_penalty, r.params.frequency_penalty] for r in reqs], device
            )[rows]  # [N, 2]
            # Frequency: every occurrence subtracts once (accumulated).
            logits.index_put_((rows, token_ids), -coef[:, 1], accumulate=True)
            # Presence: once per distinct token (duplicates write one value).
            logits[rows, token_ids] = logits[rows, token_ids] - coef[:, 0]
        return logits

    def _flat_token_ids(
        self, reqs: Sequence[Req], rows: list[int], with_prompt: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch row, token id) of every output (and prompt) token of ``rows``, flat [N]."""
        lengths = [len(reqs[b].output_ids) for b in rows]
        flat_output = list(itertools.chain.from_iterable(reqs[b].output_ids for b in rows))
        parts = [upload(flat_output, self.device, torch.long)]
        row_of = list(rows)
        if with_prompt:
            parts.extend(self._prompt_tensor(reqs[b]) for b in rows)
            lengths.extend(len(reqs[b].prompt_ids) for b in rows)
            row_of.extend(rows)
        token_ids = torch.cat(parts)  # [N]
        # On the CPU: repeats held on the device make the output size a host sync.
        batch_rows = torch.repeat_interleave(torch.tensor(row_of), torch.tensor(lengths))  # [N]
        batch_rows = batch_rows.to(self.device, non_blocking=True)
        return batch_rows, token_ids

    def _prompt_tensor(self, req: Req) -> torch.Tensor:
        cached = self._prompt_tensors.get(req)
        if cached is None or cached.numel() != len(req.prompt_ids):
            cached = upload(req.prompt_ids, self.device, torch.long)
            self._prompt_tensors[req] = cached
        return cached

    def ban_until_min_tokens(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Req],
        eos_token_ids: Collection[int],
        exempt_rows: Collection[int] = (),
    ) -> torch.Tensor:
        """Set EOS and stop token logits to -inf for rows still short of ``min_tokens``.

        ``exempt_rows``: rows whose grammar may end here; banning its stop tokens could
        leave such a row with no allowed token at all.
        """
        rows: list[int] = []
        token_ids: list[int] = []
        for b, r in enumerate(reqs):
            if b in exempt_rows:
                continue
            banned = min_tokens_banned(r.params, len(r.output_ids), eos_token_ids)
            banned = [t for t in banned if 0 <= t < logits.shape[1]]
            rows.extend([b] * len(banned))
            token_ids.extend(banned)
        if not rows:
            return logits
        logits = logits.clone()
        index = upload([rows, token_ids], logits.device, torch.long)  # [2, N]
        logits[index[0], index[1]] = float("-inf")
        return logits
