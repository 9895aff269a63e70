"""Tools in the prompt: through the chat template when it knows tools, else written here.

A template "knows tools" when it reads a ``tools`` variable. Otherwise (SmolLM2, for one)
hiserve adds the parser's instructions to the system message, writes past calls in the
parser's format, and turns tool results into ``<tool_response>`` user turns, so the
model sees one consistent format that the parser then reads back.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

from server.protocol import ChatCompletionRequest
from server.tools.definitions import ToolPlan
from server.tools.parsers import ToolCallParser, load_json

_TOOLS_VAR = re.compile(r"\btools\b")


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and _TOOLS_VAR.search(chat_template or "") is not None


def _call_arguments(call: dict[str, Any]) -> tuple[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict):
        function = {}
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # else kept as the text the client sent
            arguments = load_json(arguments)
    return str(function.get("name", "")), arguments


def with_tools(
    messages: list[dict[str, Any]],
    req: ChatCompletionRequest,
    plan: ToolPlan,
    parser: ToolCallParser,
    knows_tools: bool,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages to render and the ``tools`` argument for the template (or None).

    ``messages`` are the plain ``{role, content}`` dicts of ``req.messages``, in order.
    """
    if knows_tools:
        rendered = []
        for entry, message in zip(messages, req.messages, strict=True):
            entry = dict(entry)
            if message.tool_calls:
                entry["tool_calls"] = [
                    {"type": "function", "function": {"name": n, "arguments": a}}
                    for n, a in map(_call_arguments, message.tool_calls)
                ]
            if message.tool_call_id:
                entry["tool_call_id"] = message.tool_call_id
            rendered.append(entry)
        tools = [t.as_openai() for t in plan.tools] if plan.active else None
        return rendered, tools

    rendered = []
    for entry, message in zip(messages, req.messages, strict=True):
        entry = dict(entry)
        if message.role == "assistant" and message.tool_calls:
            calls = "\n".join(parser.render_call(*_call_arguments(c)) for c in message.tool_calls)
            entry["content"] = f"{entry['content']}\n{calls}".strip()
        elif message.role == "tool":
            entry = {
                "role": "user",
                "content": f"<tool_response>\n{entry['content']}\n</tool_response>",
            }
        rendered.append(entry)
    if plan.active:
        tools_json = json.dumps([t.as_openai() for t in plan.tools], ensure_ascii=False)
        instructions = parser.instructions(tools_json)
        if rendered and rendered[0]["role"] == "system":
            first = dict(rendered[0])
            first["content"] = f"{first['content']}\n\n{instructions}".strip()
            rendered[0] = first
        else:
            rendered.insert(0, {"role": "system", "content": instructions})
    return rendered, None
