"""From a finished reply to OpenAI's ``message.tool_calls`` (streamed: server/tools/stream.py).

finish_reason rules (OpenAI's, as vLLM applies them): ``tool_calls`` when calls were made
under "auto" or "required", ``stop`` for a named function, and ``length`` (with the raw
text as content, never a call) when the reply was cut.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass

from server.protocol import FunctionCall, ToolCall
from server.tools.definitions import ToolPlan, arguments_text
from server.tools.parsers import ParsedCall, ToolCallParser, load_json

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolOutcome:
    content: str | None
    calls: list[ParsedCall]
    finish_reason: str | None


def finish_tools(
    plan: ToolPlan, parser: ToolCallParser, text: str, finish_reason: str | None
) -> ToolOutcome:
    """The message a finished reply stands for under ``plan``."""
    if finish_reason != "stop":
        return ToolOutcome(text, [], finish_reason)
    if plan.mode == "named":
        assert plan.named is not None
        return ToolOutcome(None, [ParsedCall(plan.named, _normalised(text))], "stop")
    if plan.mode == "required":
        calls = _required_calls(text)
        if calls:
            return ToolOutcome(None, calls, "tool_calls")
        return ToolOutcome(text, [], finish_reason)
    result = parser.parse(text, [t.name for t in plan.tools])
    if result.calls:
        return ToolOutcome(result.content, result.calls, "tool_calls")
    return ToolOutcome(text, [], finish_reason)


def _normalised(arguments: str) -> str:
    try:
        return arguments_text(load_json(arguments))
    except ValueError:
        return arguments


def _required_calls(text: str) -> list[ParsedCall]:
    """The ``[{"name", "parameters"}, ...]`` array the required-call schema produces."""
    try:
        items = load_json(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        try:
            arguments = arguments_text(item.get("parameters", {}))
        except (ValueError, RecursionError):  # RecursionError: nested too deeply
            return []
        calls.append(ParsedCall(item["name"], arguments))
    return calls


def tool_calls_of(calls: list[ParsedCall]) -> list[ToolCall]:
    return [
        ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]
