"""Tool calls in a model's free text (``tool_choice`` "auto"), in the model's own format.

- ``hermes`` (also Qwen2/2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, any text before them is the message content.
- ``llama3_json``: the whole reply is ``{"name": ..., "parameters": {...}}`` (optionally
  after ``<|python_tag|>``, several separated by ``;``).

Each parser also says how much of a growing text is surely content (safe to stream), how
to ask for calls in a system prompt, and how to write a past call back into the history.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PARSER_NAMES = ("auto", "hermes", "qwen", "llama3_json")


def load_json(text: str) -> Any:
    """``json.loads``, with JSON nested past Python's recursion limit as a ValueError.

    NOTE: model output and client tool-call arguments can nest deeper than the
    interpreter's stack allows (``[[[[...``); json raises RecursionError for them, which
    would escape every ``except ValueError`` below as a 500. Such text is not a call.
    """
    try:
        return json.loads(text)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc


def dump_json(value: Any) -> str:
    """``json.dumps`` (non-ASCII kept), with too deep a value as a ValueError."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object as text


@dataclass(frozen=True)
class ParseResult:
    content: str | None  # text outside the calls; None when there is none
    calls: list[ParsedCall]


class ToolCallParser(ABC):
    """Finds tool calls in a finished reply and bounds the content of an unfinished one."""

    name: str

    @abstractmethod
    def parse(self, text: str, tool_names: Sequence[str]) -> ParseResult:
        """Calls in ``text``; none (and all of ``text`` as content) if any is malformed."""

    @abstractmethod
    def content_end(self, text: str) -> int:
        """How many leading characters of a growing ``text`` are content whatever follows."""

    @abstractmethod
    def instructions(self, tools_json: str) -> str:
        """A system prompt that teaches a model without tool support this format."""

    @abstractmethod
    def render_call(self, name: str, arguments: Any) -> str:
        """A past call of the conversation, as this format writes it."""


def _as_call(obj: Any, tool_names: Sequence[str], args_keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in tool_names:
        return None
    for key in args_keys:
        if key in obj:
            arguments = obj[key]
            break
    else:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = load_json(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    try:
        return ParsedCall(str(obj["name"]), dump_json(arguments))
    except ValueError:
        return None


class HermesParser(ToolCallParser):
    name = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str, tool_names: Sequence[str]) -> ParseResult:
        start = text.find(self.START)
        if start < 0:
            return ParseResult(text, [])
        calls = []
        for body in self._BLOCK.findall(text, start):
            try:
                obj = load_json(body.strip())
            except ValueError:
                return ParseResult(text, [])
            call = _as_call(obj, tool_names, ("arguments", "parameters"))
            if call is None:
                return ParseResult(text, [])
            calls.append(call)
        return ParseResult(text[:start].rstrip() or None, calls)

    def content_end(self, text: str) -> int:
        start = text.find(self.START)
        if start < 0:
            # Hold back a tail that may be the beginning of "<tool_call>".
            start = len(text)
            for k in range(min(len(self.START) - 1, len(text)), 0, -1):
                if self.START.startswith(text[-k:]):
                    start = len(text) - k
                    break
        # Whitespace right before a call is dropped from the content: hold it back too.
        return len(text[:start].rstrip())

    def instructions(self, tools_json: str) -> str:
        return (
            "You are a function calling AI model. You are provided with function signatures "
            "within <tools></tools> XML tags. You may call one or more functions to assist "
            "with the user query. Don't make assumptions about what values to plug into "
            f"functions. Here are the available tools: <tools>{tools_json}</tools>\n"
            "For each function call, return a JSON object with the function name and "
            "arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>"
        )

    def render_call(self, name: str, arguments: Any) -> str:
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>"


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, tool_names: Sequence[str]) -> ParseResult:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip()
        if not body.startswith("{"):
            return ParseResult(text, [])
        decoder = json.JSONDecoder()
        calls = []
        pos = 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except (ValueError, RecursionError):  # RecursionError: nested too deeply
                return ParseResult(text, [])
            call = _as_call(obj, tool_names, ("parameters", "arguments"))
            if call is None:
                return ParseResult(text, [])
            calls.append(call)
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return ParseResult(None, calls)

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or self.TAG.startswith(body[: len(self.TAG)]):
            return 0  # may still become a call: hold everything
        return len(text)

    def instructions(self, tools_json: str) -> str:
        return (
            "You have access to the following functions. To call a function, respond only "
            'with a JSON object of the form {"name": function name, "parameters": dictionary '
            "of argument name and its value}, and nothing else. Otherwise answer normally.\n"
            f"Functions: {tools_json}"
        )

    def render_call(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "llama3_json": Llama3JsonParser,
}


def choose_parser(flag: str, chat_template: str | None) -> ToolCallParser:
    """The parser ``--tool-call-parser`` names, or for "auto" the one the template implies.

    A template without tool support gets hiserve's own instructions in the Hermes format.
    """
    if flag != "auto":
        return PARSERS[flag]()
    template = chat_template or ""
    if "<|python_tag|>" in template and "<tool_call>" not in template:
        return Llama3JsonParser()
    return HermesParser()
