"""Scored prompts on /v1/completions: which choices score, and the two response shapes
(legacy ``echo`` + ``logprobs``, and vLLM's ``prompt_logprobs``).

NOTE: of the ``n`` choices of one prompt only the first scores it (a scoring request
computes its whole prompt; the others reuse that KV from the prefix cache); the rest are
given its scores. A stream holds another choice's outputs until they are known.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from engine.request import RequestOutput, TokenLogprob
from server.protocol import CompletionLogprobs, CompletionRequest, PromptLogprob

Scored = list[TokenLogprob | None]


def prompt_logprobs_of(req: CompletionRequest) -> int | None:
    """Top-N the engine scores each prompt token with, or None: no scoring."""
    wanted = []
    if req.echo and req.logprobs is not None:
        wanted.append(req.logprobs)
    if req.prompt_logprobs is not None:
        wanted.append(req.prompt_logprobs)
    return max(wanted) if wanted else None


def legacy_top(
    token_text: Callable[[int], str], entry: TokenLogprob, text: str, limit: int | None = None
) -> dict[str, float]:
    """A legacy ``top_logprobs`` entry: the ``limit`` likeliest texts (all the engine
    gave when None) plus the token's own."""
    top = {token_text(t): lp for t, lp in list(entry.top.items())[:limit]}
    top.setdefault(text, entry.logprob)
    return top


def add_legacy_prompt(
    token_text: Callable[[int], str],
    prompt_ids: list[int],
    scored: Scored | None,
    limit: int,
    out: CompletionLogprobs,
) -> None:
    """Echoed prompt tokens in the legacy format: null for the first token (and for all
    of them when the prompt was not scored), then logprob and top alternatives."""
    offset = 0
    for i, token_id in enumerate(prompt_ids):
        text = token_text(token_id)
        entry = scored[i] if scored is not None and i < len(scored) else None
        out.tokens.append(text)
        out.token_logprobs.append(None if entry is None else entry.logprob)
        out.top_logprobs.append(
            None if entry is None else legacy_top(token_text, entry, text, limit)
        )
        out.text_offset.append(offset)
        offset += len(text)


def vllm_prompt_logprobs(
    token_text: Callable[[int], str], scored: Scored, limit: int
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's shape: per prompt token, the token itself then the ``limit`` likeliest, by
    token id, each with its logprob, rank and text."""
    result: list[dict[str, PromptLogprob] | None] = []
    for entry in scored:
        if entry is None:
            result.append(None)
            continue
        table = {
            str(entry.token_id): PromptLogprob(
                logprob=entry.logprob, rank=entry.rank, decoded_token=token_text(entry.token_id)
            )
        }
        for rank, (token_id, logprob) in enumerate(list(entry.top.items())[:limit], start=1):
            table.setdefault(
                str(token_id),
                PromptLogprob(logprob=logprob, rank=rank, decoded_token=token_text(token_id)),
            )
        result.append(table)
    return result


class ScoreRelay:
    """Stream order for scored prompts: a choice's outputs wait until its prompt's scores
    (carried by the prompt's first choice) have arrived."""

    def __init__(self, n: int, active: bool) -> None:
        self.n = n
        self.active = active
        self.scores: dict[int, Scored] = {}  # prompt index -> its scores
        self.held: dict[int, list[RequestOutput]] = {}  # choice -> outputs not yet sent

    def scores_of(self, choice: int) -> Scored | None:
        return self.scores.get(choice // self.n)

    def admit(self, choice: int, out: RequestOutput) -> Iterator[tuple[int, RequestOutput]]:
        """The outputs that may go out now, in order, given ``out`` of ``choice`` arrived."""
        if not self.active:
            yield choice, out
            return
        prompt = choice // self.n
        if out.prompt_logprobs is not None and prompt not in self.scores:
            self.scores[prompt] = out.prompt_logprobs
        if prompt not in self.scores and choice % self.n != 0:
            self.held.setdefault(choice, []).append(out)
            return
        for other in range(prompt * self.n, (prompt + 1) * self.n):
            for held in self.held.pop(other, []):
                yield other, held
        yield choice, out

    def drain(self) -> Iterator[tuple[int, RequestOutput]]:
        """Whatever is still held once the stream ended (the scoring choice failed)."""
        for choice in sorted(self.held):
            for out in self.held.pop(choice):
                yield choice, out
