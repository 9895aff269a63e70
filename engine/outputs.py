"""Turn a request's state into the RequestOutput snapshot the caller sees."""

from __future__ import annotations

from collections.abc import Collection

from engine.detokenizer import StopChecker
from engine.request import FinishReason, Req, RequestOutput, TokenLogprob


def stop_checker_of(req: Req) -> StopChecker:
    """The request's stop-string checker, built on first use."""
    if req.stop_checker is None:
        req.stop_checker = StopChecker(req.params.stop)
    checker: StopChecker = req.stop_checker
    return checker


# Characters ``req.text`` may hold beyond what it must keep before the older ones move to
# ``req.text_head``: an append copies at most about this much, and a request's text moves
# about once per this many characters.
COMPACT_CHARS = 1024


def output_due(req: Req, stream_interval: int) -> bool:
    """Whether a running ``req``'s tokens since its last output go out now: its first
    token at once (time to first token), then every ``stream_interval`` tokens if its
    caller streams; otherwise they wait for the final output."""
    if req.sent_tokens == 0:
        return True
    return req.params.stream and len(req.output_ids) - req.sent_tokens >= stream_interval


def _compact(req: Req) -> None:
    """Move the front of ``req.text`` to ``req.text_head`` once it is long enough: all
    but what a stop string may still reach (``StopChecker.check`` looks back
    ``max_stop_len - 1`` characters from the newest delta; ``holdback`` at most as far)
    and, for a stream, what is not sent yet (outputs slice it out of ``text``)."""
    keep = stop_checker_of(req).max_stop_len if req.params.stop else 0
    cut = len(req.text) - keep
    if req.params.stream:
        cut = min(cut, req.sent_text - req.head_chars)
    if cut >= COMPACT_CHARS:
        req.text_head.append(req.text[:cut])
        req.text = req.text[cut:]
        req.head_chars += cut


def make_output(req: Req, finished: bool) -> RequestOutput:
    """Snapshot with the deltas since the previous snapshot of ``req``.

    While running, the tail of the text that could be the start of a stop string is held
    back, so a stream never shows part of a stop string.

    NOTE: only the final snapshot carries the totals (``token_ids``, ``text``,
    ``logprobs``); every other one carries just its deltas, so an update costs what it
    adds, never a copy of everything generated so far.
    """
    text, base = req.text, req.head_chars
    emit_upto = base + len(text)
    if not finished and req.params.stop:
        emit_upto -= stop_checker_of(req).holdback(text)
    emit_upto = max(emit_upto, req.sent_text)
    if finished or req.sent_text < base:  # the final output, or unsent text moved to the head
        text, base = "".join(req.text_head) + text, 0
    new_text = text[req.sent_text - base : emit_upto - base]
    new_ids = req.output_ids[req.sent_tokens :]
    want_logprobs = req.params.logprobs is not None
    new_logprobs = req.logprobs[req.sent_logprobs :] if want_logprobs else None
    req.sent_text = emit_upto
    req.sent_tokens = len(req.output_ids)
    req.sent_logprobs = len(req.logprobs)
    reason = req.finish_reason.value if finished and req.finish_reason is not None else None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    if req.params.prompt_logprobs is not None and (finished or not req.sent_prompt_logprobs):
        # Once per stream (its first output) plus the final output; None for token 0.
        prompt_logprobs = [None, *req.prompt_logprobs]
        req.sent_prompt_logprobs = True
    return RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_ids,
        token_ids=list(req.output_ids) if finished else [],
        text=text[:emit_upto] if finished else "",
        new_token_ids=new_ids,
        new_text=new_text,
        finished=finished,
        finish_reason=reason,
        cached_tokens=req.cached_device + req.cached_host + req.cached_storage,
        cached_tokens_device=req.cached_device,
        cached_tokens_host=req.cached_host,
        cached_tokens_storage=req.cached_storage,
        cache_miss_reasons=req.miss_reasons,
        logprobs=list(req.logprobs) if want_logprobs and finished else None,
        new_logprobs=new_logprobs,
        prompt_logprobs=prompt_logprobs,
        stop_reason=req.stop_reason,
        first_token_time=req.first_token_time,
        arrival_time=req.arrival_time,
        error=req.error if finished else None,
    )


def check_stop(
    req: Req, token: int, eos_token_ids: Collection[int], max_model_len: int
) -> FinishReason | None:
    """Why ``req`` ends after sampling ``token`` (EOS, a stop token or string, a length
    limit), or None; a matched stop string is cut from ``req.text``."""
    params = req.params
    n_out = len(req.output_ids)
    past_min = n_out >= params.min_tokens
    if past_min and not params.ignore_eos and token in eos_token_ids:
        return FinishReason.STOP
    if past_min and token in params.stop_token_ids:
        req.stop_reason = token
        return FinishReason.STOP
    assert req.detok is not None
    delta = req.detok.add([token])
    if delta:
        start = len(req.text)
        req.text += delta
        if params.stop and past_min:
            hit = stop_checker_of(req).check(req.text, start)
            if hit is not None:
                req.text = req.text[: hit[0]]
                req.stop_reason = hit[1]
                return FinishReason.STOP
        if len(req.text) >= COMPACT_CHARS:  # shorter: nothing to move
            _compact(req)
    if n_out >= params.max_tokens or len(req.prompt_ids) + n_out >= max_model_len:
        return FinishReason.LENGTH
    return None
