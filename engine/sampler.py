"""Token selection: logit bias, greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

Penalties and the ``min_tokens`` ban are engine/penalties.py, applied after the bias.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

import torch

from engine.layers.fused_cpu import cpu_argmax
from engine.penalties import Penalties, has_penalties, upload
from engine.request import Req, TokenLogprob
from engine.sampler_output import SamplerOutput

if TYPE_CHECKING:
    from engine.grammar import BatchMask


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)  # [B, V] -> [B]


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``, for one seeded request."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Picks one token per row of a logits batch, honouring each request's SamplingParams.

    Order of operations per row: the grammar mask, ``logit_bias``, repetition / presence
    / frequency penalties, the ``min_tokens`` ban on EOS and stop token ids, then either
    greedy argmax or temperature -> top-k -> top-p -> min-p (the order HF ``generate``
    applies its warpers in) followed by sampling.

    NOTE: requested logprobs are ``log_softmax`` of the RAW model logits, taken before
    the grammar mask, ``logit_bias``, penalties, the ``min_tokens`` ban and temperature
    (vLLM's default), so they describe the model, not the sampling distribution.

    NOTE: sampling draws one uniform per row and picks the token whose interval of the
    row's CDF holds it (``sample_from_cdf``), an exact sample of ``probs`` up to float32
    rounding of the running sum. A seeded row draws only from its own
    ``req.generator``, one value per step, so its tokens do not depend on which other
    requests share the batch. Unseeded rows share the sampler's generator.
    """

    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = make_generator(seed, self.device)
        # [B, V] float32 -> [B] int64 for greedy rows: on the CPU the fused kernel (many
        # times faster there) where it builds, else torch.argmax.
        self.argmax: Callable[[torch.Tensor], torch.Tensor] = (
            cpu_argmax() if self.device.type == "cpu" else None
        ) or _torch_argmax
        self.penalties = Penalties(self.device)

    def __call__(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Req],
        eos_token_ids: Collection[int],
        grammar_mask: BatchMask | None = None,
    ) -> SamplerOutput:
        # NOTE: columns past vocab_size (padded lm_head) can never be chosen.
        logits = logits[:, : self.vocab_size].float()  # [B, V]
        if 0 in logits.stride():
            # Rows that share memory (an expanded [1, V]): the grammar mask and the bias
            # write in place, and would put each row's into every row.
            logits = logits.contiguous()
        raw_logits = logits
        if grammar_mask is not None:
            logits = self.apply_grammar(logits, reqs, grammar_mask)
        batch = len(reqs)
        # NOTE: the logits are this step's own (nothing reads them after the sampler), so
        # the bias goes into them in place, as the grammar mask does; a copy only where
        # logprobs still need the raw ones (the copy was 6 MB and half a millisecond a
        # step at a batch of 32 on the CPU, 2026-12-06).
        keep_raw = logits is raw_logits and any(r.params.logprobs is not None for r in reqs)
        logits = apply_logit_bias(logits, reqs, in_place=not keep_raw)
        fast = all(
            r.params.greedy
            and r.params.logprobs is None
            and not has_penalties(r.params)
            and len(r.output_ids) >= r.params.min_tokens
            for r in reqs
        )
        if fast:
            # Fast path: one argmax over the batch, one device -> host transfer.
            return SamplerOutput(self.argmax(logits), [None] * batch)

        logits = self.penalties.apply(logits, reqs)
        logits = self.penalties.ban_until_min_tokens(
            logits, reqs, eos_token_ids, grammar_mask.may_end_rows if grammar_mask else ()
        )

        greedy_rows = [b for b, r in enumerate(reqs) if r.params.greedy]
        sample_rows = [b for b, r in enumerate(reqs) if not r.params.greedy]
        if not sample_rows:
            token_ids = self.argmax(logits)  # [B]
        elif not greedy_rows:
            token_ids = self._sample(logits, reqs)
        else:
            token_ids = torch.empty(batch, dtype=torch.long, device=logits.device)
            greedy_idx = upload(greedy_rows, logits.device, torch.long)
            sample_idx = upload(sample_rows, logits.device, torch.long)
            token_ids[greedy_idx] = self.argmax(logits[greedy_idx])
            token_ids[sample_idx] = self._sample(logits[sample_idx], [reqs[b] for b in sample_rows])
        logprobs = self._logprobs(raw_logits, token_ids, reqs)
        return SamplerOutput(token_ids, logprobs)

    # -- grammar ---------------------------------------------------------------------

    def apply_grammar(
        self, logits: torch.Tensor, reqs: Sequence[Req], grammar_mask: BatchMask
    ) -> torch.Tensor:
        """Logits with every token the constrained rows' grammars forbid set to -inf.

        NOTE: first of all steps, so penalties, temperature and top-k/top-p/min-p only
        ever see allowed tokens; unconstrained rows are not touched. Logprobs keep the
        raw logits, so the input is copied when a row asks for them.
        """
        if any(r.params.logprobs is not None for r in reqs):
            logits = logits.clone()
        grammar_mask.apply(logits)
        return logits

    # -- sampling --------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
        """Sample one token per row of ``logits`` [S, V]; every row is non-greedy."""
        num_rows, vocab = logits.shape
        params = [r.params for r in reqs]
        # One host -> device copy for all per-row knobs.
        knobs = upload(
            [
                [p.temperature for p in params],
                [p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                [p.top_p for p in params],
                [p.min_p for p in params],
            ],
            logits.device,
            torch.float64,
        )  # [4, S]
        all_top_k = all(0 < p.top_k < vocab for p in params)
        logits = filter_logits(
            logits,
            temperature=knobs[0].float(),
            top_k=knobs[1].long(),
            top_p=knobs[2].float(),
            min_p=knobs[3].float(),
            use_top_k_top_p=any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params),
            use_min_p=any(p.min_p > 0.0 for p in params),
            max_top_k=max(p.top_k for p in params) if all_top_k else None,
        )
        probs = logits.softmax(dim=-1)  # [S, V]
        # Inverse-CDF: one uniform per row, not one per vocabulary entry. (Drawing V
        # uniforms and taking logs for an exponential race cost ~10% of a CPU decode step
        # at batch 40.) Rows with their own seed draw from their own generator, so a
        # seeded row's token does not depend on its batch neighbours.
        uniform = torch.empty(num_rows, 1, device=probs.device)  # [S, 1]
        unseeded = [i for i, r in enumerate(reqs) if r.generator is None]
        if len(unseeded) == num_rows:
            uniform.uniform_(generator=self.generator)
        else:
            if unseeded:
                shared = torch.empty(len(unseeded), 1, device=probs.device)
                uniform[upload(unseeded, probs.device, torch.long)] = shared.uniform_(
                    generator=self.generator
                )
            for i, r in enumerate(reqs):
                if r.generator is not None:
                    uniform[i].uniform_(generator=r.generator)  # in place on the row view
        return sample_from_cdf(probs, uniform)

    # -- logprobs --------------------------------------------------------------------

    def _logprobs(
        self, raw_logits: torch.Tensor, token_ids: torch.Tensor, reqs: Sequence[Req]
    ) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * len(reqs)
        rows = [b for b, r in enumerate(reqs) if r.params.logprobs is not None]
        if not rows:
            return out
        if len(rows) < len(reqs):
            idx = upload(rows, raw_logits.device, torch.long)
            raw_logits, token_ids = raw_logits[idx], token_ids[idx]  # [L, V], [L]
        # log_softmax(x) = x - logsumexp(x): no [L, V] log-softmax is materialised.
        log_norm = raw_logits.logsumexp(dim=-1, keepdim=True)  # [L, 1]
        chosen = raw_logits.gather(1, token_ids.unsqueeze(1)) - log_norm  # [L, 1]
        top_n = min(max(reqs[b].params.logprobs or 0 for b in rows), raw_logits.shape[1])
        top_values, top_ids = raw_logits.topk(top_n, dim=-1)  # [L, top_n]
        top_lp = top_values - log_norm  # [L, top_n]
        chosen_list = chosen.squeeze(1).tolist()
        top_lp_list = top_lp.tolist()
        top_ids_list = top_ids.tolist()
        chosen_ids = token_ids.tolist()
        for i, b in enumerate(rows):
            n = reqs[b].params.logprobs or 0
            top = dict(zip(top_ids_list[i][:n], top_lp_list[i][:n], strict=True))
            out[b] = TokenLogprob(token_id=chosen_ids[i], logprob=chosen_list[i], top=top)
        return out


def apply_logit_bias(
    logits: torch.Tensor, reqs: Sequence[Req], in_place: bool = False
) -> torch.Tensor:
    """``logits`` [B, V] plus each row's ``logit_bias``: added into ``logits`` itself with
    ``in_place``, else into a copy (the input is not modified).

    NOTE: one host -> device upload for every biased row, and one scatter-add of the
    (row, token) pairs: O(entries), no [B, V] temporary beyond the copy. A -inf (a token
    the grammar forbids) stays -inf whatever its bias.
    """
    rows: list[int] = []
    pairs: list[tuple[int, float]] = []
    for b, r in enumerate(reqs):
        bias = r.params.logit_bias
        if bias:
            rows.extend([b] * len(bias))
            pairs.extend(bias)
    if not rows:
        return logits
    token_ids, values = zip(*pairs, strict=True)
    # NOTE: float32 holds every row and token id exactly (vocabularies are far below 2**24).
    flat = upload([rows, list(token_ids), list(values)], logits.device, torch.float32)  # [3, N]
    index = flat[:2].long()  # [2, N]: batch row, token id
    if not in_place:
        logits = logits.clone()  # [B, V]
    logits.index_put_((index[0], index[1]), flat[2], accumulate=True)
    return logits


def filter_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    use_top_k_top_p: bool = True,
    use_min_p: bool = True,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Scale by temperature and mask (-inf) what top-k, top-p and min-p remove.

    ``logits`` [S, V]; the rest [S] per row. ``top_k`` must be in [1, V] (V: disabled).
    Top-k keeps ties with the k-th value; top-p keeps the smallest prefix of the
    descending distribution (after top-k) whose mass reaches ``top_p``; min-p drops
    tokens whose probability is below ``min_p`` times the largest one. ``max_top_k``
    (every row has ``top_k <= max_top_k``) lets top-k/top-p work on a partial sort.
    """
    logits = logits / temperature.unsqueeze(1)  # [S, V]
    if use_top_k_top_p:
        # Speed: a partial sort of the W largest where that suffices, else a full sort.
        partial = _partial_sort(logits, top_k, top_p, max_top_k)
        full_log_norm = None
        if partial is not None:
            sorted_logits, order, full_log_norm = partial  # [S, W], [S, W], [S, 1] | None
        else:
            sorted_logits, order = logits.sort(dim=-1, descending=True)  # [S, V]
        width = sorted_logits.shape[1]
        kth = sorted_logits.gather(1, (top_k.clamp(max=width) - 1).unsqueeze(1))  # [S, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        log_norm = sorted_logits.logsumexp(dim=-1, keepdim=True)  # [S, 1]
        if full_log_norm is not None:
            # NOTE: rows without top-k are normalised over the whole vocabulary, not
            # over the W candidates, or top-p would cut too early.
            log_norm = torch.where((top_k > width).unsqueeze(1), full_log_norm, log_norm)
        sorted_probs = (sorted_logits - log_norm).exp()  # [S, W or V]
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # exclusive prefix sum
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        drop[:, 0] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
    if use_min_p:
        probs = logits.softmax(dim=-1)  # [S, V]
        floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [S, 1]
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


# Candidates a CPU top-p filter examines before it falls back to a full sort.
TOP_P_CANDIDATES = 1024


def _partial_sort(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_top_k: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The W largest logits per row if top-k/top-p need no more, else None.

    Returns (values [S, W], ids [S, W], log-normaliser of the whole row [S, 1] or None).
    With every row limited by top-k, W is the largest k. On CPU, where sorting the
    vocabulary dominates the sampler, ``TOP_P_CANDIDATES`` also suffice when each row
    either has a top-k within them or no top-k and candidates that hold its ``top_p``
    mass. That check costs a device sync, so GPUs always sort.
    """
    vocab = logits.shape[1]
    if max_top_k is not None:
        if max_top_k >= vocab:
            return None
        values, ids = logits.topk(max_top_k, dim=-1)  # [S, K]
        return values, ids, None
    if logits.device.type != "cpu" or vocab <= 4 * TOP_P_CANDIDATES:
        return None
    values, ids = logits.topk(TOP_P_CANDIDATES, dim=-1)  # [S, W]
    log_norm = logits.logsumexp(dim=-1, keepdim=True)  # [S, 1]
    mass = (values - log_norm).exp().sum(dim=-1)  # [S]
    # NOTE: a small margin so rounding never moves the top-p cut past the candidates.
    no_top_k = top_k >= vocab
    covered = (top_k <= TOP_P_CANDIDATES) | (no_top_k & (top_p < 1.0) & (mass >= top_p + 1e-4))
    return (values, ids, log_norm) if bool(covered.all()) else None


def sample_from_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` [S, V] (rows summing to about 1), the token whose CDF interval
    holds ``uniform`` [S, 1] (each in [0, 1)) scaled to the row's total mass: [S] ids.

    NOTE: the first index whose running sum exceeds the draw, so a token of probability 0
    (masked by a grammar, top-k/top-p, or padding) is never picked: its running sum
    equals its predecessor's. The draw is kept below the row's total, which the last
    token of positive probability reaches, so an index always exists.
    """
    cdf = probs.cumsum(dim=-1)  # [S, V], non-decreasing
    total = cdf[:, -1:]  # [S, 1]
    draw = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, draw, right=True).squeeze(1)  # [S]
