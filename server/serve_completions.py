"""POST /v1/completions: legacy text completions, plain and streaming."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.request import RequestOutput, TokenLogprob
from server.constraints import parse_checked, request_constraint
from server.engine_client import EngineClient
from server.errors import APIError
from server.metrics import RequestTimer, ServerMetrics
from server.prompt_scores import (
    Scored,
    ScoreRelay,
    add_legacy_prompt,
    legacy_top,
    prompt_logprobs_of,
    vllm_prompt_logprobs,
)
from server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
    random_id,
)
from server.serving import (
    Item,
    Plan,
    chain_first,
    check_request,
    collect,
    make_plan,
    make_timers,
    make_usage,
    prime,
    start_generation,
    stream_error_event,
    until_disconnect,
)
from server.sse import SSE_DONE, SSEResponse, sse_event

DEFAULT_MAX_TOKENS = 16


def _vllm_scores(
    client: EngineClient, req: CompletionRequest, scored: Scored | None
) -> list[dict[str, PromptLogprob] | None] | None:
    """The choice's ``prompt_logprobs`` when the request asked for them (vLLM's field)."""
    if req.prompt_logprobs is None or scored is None:
        return None
    return vllm_prompt_logprobs(client.token_text, scored, req.prompt_logprobs)


class LogprobBuilder:
    """Legacy logprobs of one choice, built incrementally; ``offset`` runs over the text."""

    def __init__(self, client: EngineClient, offset: int, limit: int) -> None:
        self.client = client
        self.offset = offset
        self.limit = limit  # top alternatives per token (the request's logprobs)

    def prompt(self, prompt_ids: list[int], scored: Scored | None, out: CompletionLogprobs) -> None:
        add_legacy_prompt(self.client.token_text, prompt_ids, scored, self.limit, out)

    def generated(self, entries: list[TokenLogprob], out: CompletionLogprobs) -> None:
        for entry in entries:
            text = self.client.token_text(entry.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(entry.logprob)
            out.top_logprobs.append(legacy_top(self.client.token_text, entry, text))
            out.text_offset.append(self.offset)
            self.offset += len(text)


def _check_scoring(req: CompletionRequest) -> None:
    if req.max_tokens == 0 and not req.echo:
        raise APIError(
            400,
            "max_tokens must be >= 1; 0 is allowed only with echo: true (score the prompt, "
            "generate nothing)",
            param="max_tokens",
        )


async def serve_completion(
    req: CompletionRequest, request: Request, client: EngineClient, metrics: ServerMetrics
) -> Response:
    start = time.perf_counter()
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of > (req.n or 1):
        raise APIError(
            400,
            f"best_of={req.best_of} > n={req.n or 1} is not supported; best_of may only equal n",
            param="best_of",
        )
    _check_scoring(req)
    grammar = await parse_checked(request_constraint(req))
    # Normalise the four prompt shapes into a list of texts or token-id lists.
    prompt = req.prompt
    items: list[str] | list[list[int]]
    if isinstance(prompt, str):
        items = [prompt]
    elif not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    elif isinstance(prompt[0], int):
        items = [list(prompt)]  # type: ignore[arg-type]
    else:
        items = list(prompt)  # type: ignore[assignment]
    if any(isinstance(p, list) and not p for p in items):
        raise APIError(400, "prompt must not contain an empty token list", param="prompt")
    check_request(req, client, num_prompts=len(items))

    texts = [p for p in items if isinstance(p, str)]
    for text in texts:
        client.check_text_size([text], "prompt")
    encoded = iter(await client.encode_many(texts)) if texts else iter(())
    prompt_ids = [next(encoded) if isinstance(p, str) else p for p in items]
    echo_texts: list[str] = []
    if req.echo:
        for p, ids in zip(items, prompt_ids, strict=True):
            echo_texts.append(p if isinstance(p, str) else await client.decode(ids))

    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    plan = make_plan(
        client,
        req,
        random_id("cmpl"),
        prompt_ids,
        lambda _: max_tokens,
        req.logprobs,
        "prompt",
        grammar,
        authorization=request.headers.get("authorization"),
        prompt_logprobs=prompt_logprobs_of(req),
    )
    gen = start_generation(client, plan)
    timers = make_timers(metrics, start, plan.num_choices)
    if req.stream:
        first = await prime(request, gen, "prompt")
        return SSEResponse(_stream(req, plan, client, chain_first(first, gen), timers, echo_texts))

    finals = await until_disconnect(request, collect(gen, timers, "prompt"))
    choices = []
    for k in range(plan.num_choices):
        out = finals[k]
        text, logprobs = out.text, None
        echo = echo_texts[k // plan.n] if req.echo else ""
        # The prompt's first choice scored it for all of them (see make_plan).
        scored = out.prompt_logprobs or finals[k - k % plan.n].prompt_logprobs
        if req.logprobs is not None:
            logprobs = CompletionLogprobs()
            builder = LogprobBuilder(client, len(echo), req.logprobs)
            if req.echo:
                builder.prompt(out.prompt_token_ids, scored, logprobs)
            builder.generated(out.logprobs or [], logprobs)
        choices.append(
            CompletionChoice(
                index=k,
                text=echo + text,
                logprobs=logprobs,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
                prompt_logprobs=_vllm_scores(client, req, scored),
            )
        )
    body = CompletionResponse(
        id=plan.base_id,
        model=client.served_model_name,
        choices=choices,
        usage=make_usage(plan, finals),
    )
    return JSONResponse(body.model_dump())


async def _stream(
    req: CompletionRequest,
    plan: Plan,
    client: EngineClient,
    outputs: AsyncIterator[Item],
    timers: list[RequestTimer],
    echo_texts: list[str],
) -> AsyncIterator[str]:
    created = int(time.time())
    model = client.served_model_name
    started = [False] * plan.num_choices
    builders: list[LogprobBuilder | None] = [None] * plan.num_choices
    finals: dict[int, RequestOutput] = {}
    relay = ScoreRelay(plan.n, active=prompt_logprobs_of(req) is not None and plan.n > 1)

    def chunk(k: int, out: RequestOutput) -> str | None:
        text, logprobs = out.new_text, None
        first = not started[k]
        started[k] = True
        echo = echo_texts[k // plan.n] if req.echo and first else ""
        scored = (out.prompt_logprobs or relay.scores_of(k)) if first else None
        if req.logprobs is not None:
            logprobs = CompletionLogprobs()
            if builders[k] is None:
                builders[k] = LogprobBuilder(client, len(echo), req.logprobs)
            builder = builders[k]
            assert builder is not None
            if echo:
                builder.prompt(out.prompt_token_ids, scored, logprobs)
            builder.generated(out.new_logprobs or [], logprobs)
        if out.finished:
            finals[k] = out
        if not (echo or text or (logprobs and logprobs.tokens) or out.finished or scored):
            return None
        choice = CompletionChoice(
            index=k,
            text=echo + text,
            logprobs=logprobs,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason if out.finished else None,
            prompt_logprobs=_vllm_scores(client, req, scored),
        )
        return sse_event(
            CompletionChunk(id=plan.base_id, created=created, model=model, choices=[choice])
        )

    try:
        async for k, arrived in outputs:
            timers[k].observe(arrived)
            for index, out in relay.admit(k, arrived):
                event = chunk(index, out)
                if event is not None:
                    yield event
        for index, out in relay.drain():
            event = chunk(index, out)
            if event is not None:
                yield event
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse_event(
                CompletionChunk(
                    id=plan.base_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage=make_usage(plan, finals),
                )
            )
    except Exception as exc:
        yield stream_error_event(exc, "prompt")
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    yield SSE_DONE
