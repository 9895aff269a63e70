"""POST /v1/completions: legacy text completions, plain and streaming."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from engine.request import RequestOutput, TokenLogprob
from server.constraints import parse_checked, request_constraint
from server.endpoint_frame import Endpoint, serve
from server.engine_client import EngineClient
from server.errors import APIError
from server.metrics import ServerMetrics
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
    UsageInfo,
    random_id,
)
from server.serving import Plan, check_request, make_plan, make_usage
from server.sse import sse_event
from server.text_event import TextEvent

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


class CompletionEndpoint(Endpoint):
    """/v1/completions: one or many prompts, echo and prompt scores, legacy logprobs."""

    prompt_field = "prompt"
    req: CompletionRequest

    def __init__(self, req: CompletionRequest, client: EngineClient) -> None:
        super().__init__(req, client)
        self.echo_texts: list[str] = []  # per prompt, when echo is on
        self.started: set[int] = set()  # choices whose first chunk went out
        self.builders: dict[int, LogprobBuilder] = {}
        self.relay: ScoreRelay | None = None
        self.text_events: dict[int, TextEvent] = {}  # per choice: chunks of text alone

    async def plan(self, request: Request) -> Plan:
        req, client = self.req, self.client
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of > (req.n or 1):
            raise APIError(
                400,
                f"best_of={req.best_of} > n={req.n or 1} is not supported; best_of may only "
                "equal n",
                param="best_of",
            )
        _check_scoring(req)
        grammar = await parse_checked(request_constraint(req))
        items = _prompt_items(req)
        check_request(req, client, num_prompts=len(items))
        texts = [p for p in items if isinstance(p, str)]
        for text in texts:
            client.check_text_size([text], "prompt")
        encoded = iter(await client.encode_many(texts)) if texts else iter(())
        prompt_ids = [next(encoded) if isinstance(p, str) else p for p in items]
        if req.echo:
            for p, ids in zip(items, prompt_ids, strict=True):
                self.echo_texts.append(p if isinstance(p, str) else await client.decode(ids))
        max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        plan = make_plan(
            client,
            req,
            random_id("cmpl"),
            prompt_ids,
            lambda _: max_tokens,
            req.logprobs,
            "logprobs",
            grammar,
            authorization=request.headers.get("authorization"),
            prompt_logprobs=prompt_logprobs_of(req),
        )
        self.relay = ScoreRelay(plan.n, active=prompt_logprobs_of(req) is not None and plan.n > 1)
        return plan

    def reply(self, plan: Plan, finals: dict[int, RequestOutput]) -> CompletionResponse:
        req, client = self.req, self.client
        choices = []
        for k in range(plan.num_choices):
            out = finals[k]
            text, logprobs = out.text, None
            echo = self.echo_texts[k // plan.n] if req.echo else ""
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
        return CompletionResponse(
            id=plan.base_id,
            model=client.served_model_name,
            choices=choices,
            usage=make_usage(plan, finals),
        )

    def deltas(self, plan: Plan, k: int, out: RequestOutput) -> list[str]:
        assert self.relay is not None
        events = (self._chunk(plan, index, held) for index, held in self.relay.admit(k, out))
        return [e for e in events if e is not None]

    def flush(self, plan: Plan) -> list[str]:
        assert self.relay is not None
        events = (self._chunk(plan, index, held) for index, held in self.relay.drain())
        return [e for e in events if e is not None]

    def usage_event(self, plan: Plan, usage: UsageInfo) -> str:
        model = self.client.served_model_name
        return sse_event(
            CompletionChunk(
                id=plan.base_id, created=self.created, model=model, choices=[], usage=usage
            )
        )

    def _chunk(self, plan: Plan, k: int, out: RequestOutput) -> str | None:
        req, client = self.req, self.client
        text, logprobs = out.new_text, None
        if self._text_only(k, out):
            return self._text_event(plan, k)(text) if text else None
        first = k not in self.started
        self.started.add(k)
        echo = self.echo_texts[k // plan.n] if req.echo and first else ""
        assert self.relay is not None
        scored = (out.prompt_logprobs or self.relay.scores_of(k)) if first else None
        if req.logprobs is not None:
            logprobs = CompletionLogprobs()
            builder = self.builders.get(k)
            if builder is None:
                builder = self.builders[k] = LogprobBuilder(client, len(echo), req.logprobs)
            if echo:
                builder.prompt(out.prompt_token_ids, scored, logprobs)
            builder.generated(out.new_logprobs or [], logprobs)
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
        return self._event(plan, choice)

    def _text_only(self, k: int, out: RequestOutput) -> bool:
        """Whether choice k's chunk for ``out`` carries its new text and nothing else, as
        most do: no echo or scores (the first chunk's), no logprobs, no finish reason (the
        last's)."""
        return not (k not in self.started or out.finished or self.req.logprobs is not None)

    def _event(self, plan: Plan, choice: CompletionChoice) -> str:
        model = self.client.served_model_name
        return sse_event(
            CompletionChunk(id=plan.base_id, created=self.created, model=model, choices=[choice])
        )

    def _text_event(self, plan: Plan, k: int) -> TextEvent:
        event = self.text_events.get(k)
        if event is None:
            event = self.text_events[k] = TextEvent(
                lambda text: self._event(plan, CompletionChoice(index=k, text=text))
            )
        return event


def _prompt_items(req: CompletionRequest) -> list[str] | list[list[int]]:
    """The four prompt shapes as a list of texts or token-id lists."""
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
    return items


async def serve_completion(
    req: CompletionRequest, request: Request, client: EngineClient, metrics: ServerMetrics
) -> Response:
    return await serve(CompletionEndpoint(req, client), request, metrics)
