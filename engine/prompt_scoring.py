"""Prompt scoring: the logprob of each prompt token given its prefix, from a prefill's
hidden states (what evaluation harnesses read through ``echo`` + ``logprobs``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.request import Req, TokenLogprob
from engine.scheduled_batch import ScheduledBatch

# Logits rows scored at once: bounds the [rows, vocab] float32 temporary (~64 MB).
SCORE_ELEMENTS = 1 << 24


def scoring_rows(batch: ScheduledBatch) -> list[tuple[Req, int, int, int]]:
    """(request, first row in the batch's tokens, first position, count) of every prompt
    position in ``batch`` whose logits score a prompt token not scored yet.

    Position i predicts prompt token i + 1, so positions ``[0, len(prompt) - 1)`` score
    the prompt. A request scores its positions in order exactly once: a chunk recomputed
    after a retraction starts at or below what it already scored and skips that part.
    """
    rows: list[tuple[Req, int, int, int]] = []
    offset = 0
    for req, start, n in zip(batch.reqs, batch.starts, batch.extend_lens):
        if req.scoring_prompt:
            first = max(start, len(req.prompt_logprobs))
            end = min(start + n, len(req.prompt_ids) - 1)
            if first < end:
                rows.append((req, offset + first - start, first, end - first))
        offset += n
    return rows


def score_prompts(
    hidden: torch.Tensor,
    batch: ScheduledBatch,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
) -> None:
    """Append to each scoring request's ``prompt_logprobs`` what this batch computed.

    ``hidden`` [T, hidden]: the batch's final hidden states, one row per token.
    Logprobs are ``log_softmax`` of the raw logits (as for generated tokens); ``rank`` is
    1 + the number of tokens with a strictly larger logit.
    """
    for req, row, position, count in scoring_rows(batch):
        top_n = req.params.prompt_logprobs or 0
        targets = req.prompt_ids[position + 1 : position + 1 + count]
        per_chunk = max(1, SCORE_ELEMENTS // vocab_size)
        for lo in range(0, count, per_chunk):
            hi = min(count, lo + per_chunk)
            logits = compute_logits(hidden[row + lo : row + hi])[:, :vocab_size].float()
            req.prompt_logprobs.extend(_score(logits, targets[lo:hi], top_n))  # [hi - lo, V]


def _score(logits: torch.Tensor, targets: list[int], top_n: int) -> list[TokenLogprob]:
    """One TokenLogprob per row of ``logits`` [R, V] for the token ``targets[r]``."""
    target = torch.tensor(targets, dtype=torch.long, device=logits.device).unsqueeze(1)  # [R, 1]
    log_norm = logits.logsumexp(dim=-1, keepdim=True)  # [R, 1]
    chosen_logit = logits.gather(1, target)  # [R, 1]
    chosen = (chosen_logit - log_norm).squeeze(1).tolist()
    ranks = ((logits > chosen_logit).sum(dim=-1) + 1).tolist()
    tops: list[dict[int, float]] = [{} for _ in targets]
    if top_n > 0:
        values, ids = logits.topk(min(top_n, logits.shape[1]), dim=-1)  # [R, top_n]
        tops = [
            dict(zip(row_ids, row_lp, strict=True))
            for row_ids, row_lp in zip(ids.tolist(), (values - log_norm).tolist(), strict=True)
        ]
    return [
        TokenLogprob(token_id=t, logprob=lp, top=top, rank=rank)
        for t, lp, top, rank in zip(targets, chosen, tops, ranks, strict=True)
    ]
