"""POST /v1/chat/completions: messages through the chat template, plain and streaming."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.grammar_spec import GrammarSpec
from engine.request import RequestOutput, TokenLogprob
from server.constraints import parse_checked, request_constraint, statically_checked
from server.endpoint_frame import Endpoint, serve
from server.engine_client import EngineClient
from server.errors import APIError
from server.metrics import ServerMetrics
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
    UsageInfo,
    random_id,
)
from server.serving import Plan, check_request, make_plan, make_usage
from server.sse import sse_event
from server.text_event import TextEvent
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


class ChatEndpoint(Endpoint):
    """/v1/chat/completions: messages through the chat template, tools, chat deltas."""

    prompt_field = "messages"
    req: ChatCompletionRequest

    def __init__(self, req: ChatCompletionRequest, client: EngineClient) -> None:
        super().__init__(req, client)
        self.tools = ToolPlan([], "none")  # set by ``plan``, after the cheaper checks
        self.started: set[int] = set()  # choices whose role chunk went out
        self.tool_streams: dict[int, ToolStream] = {}
        self.text_events: dict[int, TextEvent] = {}  # per choice: chunks of content alone

    async def plan(self, request: Request) -> Plan:
        req, client = self.req, self.client
        check_request(req, client)
        _check_chat_fields(req)
        tools = self.tools = tool_plan(req)
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

        return make_plan(
            client,
            req,
            random_id("chatcmpl"),
            [prompt_ids],
            max_tokens,
            (req.top_logprobs or 0) if req.logprobs else None,
            "top_logprobs",
            grammar,
            authorization=request.headers.get("authorization"),
        )

    def reply(self, plan: Plan, finals: dict[int, RequestOutput]) -> ChatCompletionResponse:
        req, client, tools = self.req, self.client, self.tools
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
            logprobs = chat_logprobs(client, finals[k].logprobs or []) if req.logprobs else None
            choices.append(
                ChatChoice(
                    index=k,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=finals[k].stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=plan.base_id,
            model=client.served_model_name,
            choices=choices,
            usage=make_usage(plan, finals),
        )

    def deltas(self, plan: Plan, k: int, out: RequestOutput) -> list[str]:
        if self._text_only(k, out):
            return [self._text_event(plan, k)(out.new_text)] if out.new_text else []
        events = []
        if k not in self.started:
            self.started.add(k)
            role = DeltaMessage(role="assistant", content="")
            events.append(self._chunk(plan, [ChatStreamChoice(index=k, delta=role)]))
        logprobs = None
        if self.req.logprobs and out.new_logprobs:
            logprobs = chat_logprobs(self.client, out.new_logprobs)
        if self.tools.active:
            stream = self.tool_streams.get(k)
            if stream is None:
                stream = self.tool_streams[k] = ToolStream(self.tools, self.client.tool_parser)
            for event in _tool_events(k, out, logprobs, stream):
                events.append(self._chunk(plan, [event]))
            return events
        if out.new_text or logprobs or out.finished:
            delta = DeltaMessage(content=out.new_text or None)
            choice = ChatStreamChoice(
                index=k, delta=delta, logprobs=logprobs, finish_reason=out.finish_reason
            )
            events.append(self._chunk(plan, [choice]))
        return events

    def usage_event(self, plan: Plan, usage: UsageInfo) -> str:
        return self._chunk(plan, [], usage)

    def _text_only(self, k: int, out: RequestOutput) -> bool:
        """Whether choice k's chunk for ``out`` carries its new content and nothing else,
        as most do: no role (the first chunk's), no tool calls, logprobs or finish reason
        (the last's)."""
        return not (
            k not in self.started
            or out.finished
            or self.tools.active
            or (self.req.logprobs and out.new_logprobs)
        )

    def _text_event(self, plan: Plan, k: int) -> TextEvent:
        event = self.text_events.get(k)
        if event is None:
            event = self.text_events[k] = TextEvent(
                lambda text: self._chunk(
                    plan, [ChatStreamChoice(index=k, delta=DeltaMessage(content=text))]
                )
            )
        return event

    def _chunk(
        self, plan: Plan, choices: list[ChatStreamChoice], usage: UsageInfo | None = None
    ) -> str:
        model = self.client.served_model_name
        return _chunk_event(
            ChatCompletionChunk(
                id=plan.base_id, created=self.created, model=model, choices=choices, usage=usage
            )
        )


async def serve_chat(
    req: ChatCompletionRequest, request: Request, client: EngineClient, metrics: ServerMetrics
) -> Response:
    return await serve(ChatEndpoint(req, client), request, metrics)


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
