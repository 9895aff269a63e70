"""POST /v1/chat/completions: messages through the chat template, plain and streaming."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.grammar_spec import GrammarSpec
from engine.request import RequestOutput, TokenLogprob
from server.constraints import parse_checked, request_constraint, statically_checked
from server.engine_client import EngineClient
from server.errors import APIError
from server.metrics import RequestTimer, ServerMetrics
from server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
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
from server.tools.definitions import ToolPlan, tool_plan
from server.tools.prompt import with_tools
from server.tools.response import finish_tools, tool_calls_of
from server.tools.stream import ToolStream


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """Plain ``{role, content}`` dicts for the chat template; text content only."""
    messages = []
    for i, message in enumerate(req.messages):
        content = message.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            parts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400,
                        f"content part type {part.type!r} is not supported; only text parts are",
                        param=f"messages.{i}.content.{j}",
                    )
                parts.append(part.text)
            text = "\n".join(parts)
        # Chat templates know "system"; "developer" is OpenAI's newer name for it.
        role = "system" if message.role == "developer" else message.role
        entry = {"role": role, "content": text}
        if message.name:
            entry["name"] = message.name
        messages.append(entry)
    return messages


def _check_chat_fields(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    if req.prompt_logprobs is not None:
        raise APIError(
            400,
            "prompt_logprobs is not supported on /v1/chat/completions; score prompts on "
            "/v1/completions (prompt_logprobs, or echo with logprobs)",
            param="prompt_logprobs",
        )
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )


def chat_constraint(req: ChatCompletionRequest, tools: ToolPlan) -> GrammarSpec | None:
    """The request's output constraint: its own, or the one a required/named tool call needs."""
    grammar = request_constraint(req)
    tool_grammar = tools.constraint() if tools.active else None
    if tool_grammar is None:
        return grammar
    if grammar is not None:
        raise APIError(
            400,
            f"tool_choice {req.tool_choice!r} already constrains the output; it cannot be "
            f"combined with {grammar.param}",
            param=grammar.param,
        )
    return statically_checked(tool_grammar)


def chat_logprobs(client: EngineClient, entries: list[TokenLogprob]) -> ChatLogprobs:
    content = []
    for entry in entries:
        text = client.token_text(entry.token_id)
        top = [
            ChatTopLogprob(
                token=(t := client.token_text(tid)), logprob=lp, bytes=list(t.encode("utf-8"))
            )
            for tid, lp in sorted(entry.top.items(), key=lambda kv: -kv[1])
        ]
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=entry.logprob,
                bytes=list(text.encode("utf-8")),
                top_logprobs=top,
            )
        )
    return ChatLogprobs(content=content)


async def serve_chat(
    req: ChatCompletionRequest, request: Request, client: EngineClient, metrics: ServerMetrics
) -> Response:
    start = time.perf_counter()
    check_request(req, client)
    _check_chat_fields(req)
    tools = tool_plan(req)
    grammar = await parse_checked(chat_constraint(req, tools))
    messages, tool_defs = with_tools(
        chat_messages(req), req, tools, client.tool_parser, client.template_knows_tools
    )
    prompt_ids = await client.render_chat(
        messages,
        add_generation_prompt=req.add_generation_prompt is not False,
        continue_final_message=bool(req.continue_final_message),
        tools=tool_defs,
    )
    requested = req.max_completion_tokens or req.max_tokens
    room = client.max_model_len - len(prompt_ids)

    def max_tokens(_: list[int]) -> int:
        # Unset: whatever the context leaves (at least 1, so a too-long prompt gets its 400).
        return requested if requested is not None else max(room, 1)

    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    plan = make_plan(
        client,
        req,
        random_id("chatcmpl"),
        [prompt_ids],
        max_tokens,
        logprobs,
        "messages",
        grammar,
        authorization=request.headers.get("authorization"),
    )
    gen = start_generation(client, plan)
    timers = make_timers(metrics, start, plan.num_choices)
    if req.stream:
        first = await prime(request, gen, "messages")
        return SSEResponse(_stream(req, plan, client, chain_first(first, gen), timers, tools))

    finals = await until_disconnect(request, collect(gen, timers, "messages"))
    choices = []
    for k in range(plan.num_choices):
        message = ChatResponseMessage(content=finals[k].text)
        finish_reason = finals[k].finish_reason
        if tools.active:
            outcome = finish_tools(tools, client.tool_parser, finals[k].text, finish_reason)
            message = ChatResponseMessage(
                content=outcome.content, tool_calls=tool_calls_of(outcome.calls) or None
            )
            finish_reason = outcome.finish_reason
        choices.append(
            ChatChoice(
                index=k,
                message=message,
                logprobs=chat_logprobs(client, finals[k].logprobs or []) if req.logprobs else None,
                finish_reason=finish_reason,
                stop_reason=finals[k].stop_reason,
            )
        )
    body = ChatCompletionResponse(
        id=plan.base_id,
        model=client.served_model_name,
        choices=choices,
        usage=make_usage(plan, finals),
    )
    return JSONResponse(body.model_dump())


def _tool_events(
    k: int, out: RequestOutput, logprobs: ChatLogprobs | None, stream: ToolStream
) -> list[ChatStreamChoice]:
    """Choice k's stream events for one output when tools are on: content as soon as it
    cannot be part of a call, each call's id and name, then its arguments as written."""
    events = []
    content, calls = stream.feed(out.new_text)
    if content or logprobs:
        events.append(
            ChatStreamChoice(
                index=k, delta=DeltaMessage(content=content or None), logprobs=logprobs
            )
        )
    if out.finished:
        rest, final_calls, outcome = stream.finish(out.finish_reason)
        calls += final_calls
        if rest:
            events.append(ChatStreamChoice(index=k, delta=DeltaMessage(content=rest)))
    for fragment in calls:
        events.append(ChatStreamChoice(index=k, delta=DeltaMessage(tool_calls=fragment)))
    if out.finished:
        events.append(
            ChatStreamChoice(index=k, delta=DeltaMessage(), finish_reason=outcome.finish_reason)
        )
    return events


def _chunk_event(chunk: ChatCompletionChunk) -> str:
    # A delta lists only what it carries: {"role": ...}, {"content": ...} or {} at the end.
    payload: dict[str, Any] = chunk.model_dump()
    for choice, model in zip(payload["choices"], chunk.choices, strict=True):
        choice["delta"] = model.delta.model_dump(exclude_none=True)
    return sse_event(payload)


async def _stream(
    req: ChatCompletionRequest,
    plan: Plan,
    client: EngineClient,
    outputs: AsyncIterator[Item],
    timers: list[RequestTimer],
    tools: ToolPlan,
) -> AsyncIterator[str]:
    created = int(time.time())
    model = client.served_model_name
    started = [False] * plan.num_choices
    finals = {}
    tool_streams = [ToolStream(tools, client.tool_parser) for _ in range(plan.num_choices)]

    def chunk(choices: list[ChatStreamChoice]) -> str:
        return _chunk_event(
            ChatCompletionChunk(id=plan.base_id, created=created, model=model, choices=choices)
        )

    try:
        async for k, out in outputs:
            timers[k].observe(out)
            if not started[k]:
                started[k] = True
                yield chunk(
                    [ChatStreamChoice(index=k, delta=DeltaMessage(role="assistant", content=""))]
                )
            logprobs = None
            if req.logprobs and out.new_logprobs:
                logprobs = chat_logprobs(client, out.new_logprobs)
            if out.finished:
                finals[k] = out
            if tools.active:
                for event in _tool_events(k, out, logprobs, tool_streams[k]):
                    yield chunk([event])
                continue
            if not (out.new_text or logprobs or out.finished):
                continue
            delta = DeltaMessage(content=out.new_text or None)
            yield chunk(
                [
                    ChatStreamChoice(
                        index=k, delta=delta, logprobs=logprobs, finish_reason=out.finish_reason
                    )
                ]
            )
        if req.stream_options is not None and req.stream_options.include_usage:
            yield _chunk_event(
                ChatCompletionChunk(
                    id=plan.base_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage=make_usage(plan, finals),
                )
            )
    except Exception as exc:
        yield stream_error_event(exc, "messages")
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    yield SSE_DONE
