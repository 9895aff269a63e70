"""One choice's reply with tools, streamed: content as soon as it cannot be a call, and each
call's id and name as soon as they are known, then its ``arguments`` as they are written.

OpenAI's shape: ``delta.tool_calls[{index, id, type, function: {name, arguments: ""}}]``
once per call, then ``{index, function: {arguments: <fragment>}}`` as the model writes
them; concatenating the fragments of an index gives the call's ``arguments``. The
fragments are the canonical form the final parse sends (server/tools/json_prefix.py), so
a reply that ends as a call reassembles to the non-streamed message.

NOTE: a call already under way cannot be taken back. A reply cut by ``max_tokens`` (or one
the final parse refuses) after a call started ends the stream with the partial call and
its finish_reason, as OpenAI streams it; the non-streamed reply has the raw text as content.
"""

from __future__ import annotations

import logging

from server.protocol import DeltaFunctionCall, DeltaToolCall
from server.tools.definitions import ToolPlan
from server.tools.json_prefix import CallProgress, canonical_prefix, scan_call
from server.tools.parsers import HermesParser, ParsedCall, ToolCallParser
from server.tools.response import ToolOutcome, finish_tools, new_call_id

logger = logging.getLogger("hiserve.server")

CallDelta = list[DeltaToolCall]


class ToolStream:
    """One choice's reply as it streams (see the module docstring).

    NOTE: what ``feed`` emits as content is always a prefix of the content ``finish``
    settles on, and each call's argument fragments a prefix of its final arguments.
    """

    def __init__(self, plan: ToolPlan, parser: ToolCallParser) -> None:
        self.plan = plan
        self.parser = parser
        self.names = [t.name for t in plan.tools]
        self.text = ""
        self.sent = 0  # characters of content already streamed
        self.calls: list[tuple[str, str]] = []  # (name, arguments sent) per started call
        self._broken = False  # the growing text stopped looking like calls

    def feed(self, new_text: str) -> tuple[str, list[CallDelta]]:
        """Content that can be streamed now, and the call fragments that can."""
        self.text += new_text
        content = ""
        if self.plan.mode == "auto":
            end = self.parser.content_end(self.text)
            if end > self.sent:
                content = self.text[self.sent : end]
                self.sent = end
        return content, self._call_deltas(self._progress())

    def finish(self, finish_reason: str | None) -> tuple[str, list[CallDelta], ToolOutcome]:
        """(content still to stream, the call fragments still to send, the outcome)."""
        outcome = finish_tools(self.plan, self.parser, self.text, finish_reason)
        if self.calls and not outcome.calls:
            return "", [], outcome  # a started call cannot be taken back (module NOTE)
        content = outcome.content or ""
        streamed = self.text[: self.sent]
        if not content.startswith(streamed):  # cannot happen if content_end is right
            raise RuntimeError("tool-call stream emitted content the final parse disowned")
        return content[self.sent :], self._final_deltas(outcome.calls), outcome

    # ---------------------------------------------------------------- calls
    def _progress(self) -> list[CallProgress]:
        """Every call of the text so far, as far as it is written; [] when unsure."""
        if self._broken:
            return []
        try:
            if self.plan.mode == "named":
                arguments, end = canonical_prefix(self.text)
                name = self.plan.named
                return [CallProgress(name, arguments, end is not None, end)]
            if self.plan.mode == "required":
                return self._array_calls()
            if isinstance(self.parser, HermesParser):
                return self._hermes_calls()
        except ValueError:
            self._broken = True  # not JSON: the final parse decides, nothing more streams
        return []

    def _array_calls(self) -> list[CallProgress]:
        """``[{"name": ..., "parameters": {...}}, ...]`` (the required-call schema)."""
        text = self.text
        i = len(text) - len(text.lstrip())
        if i == len(text):
            return []
        if text[i] != "[":
            raise ValueError("not an array of calls")
        found: list[CallProgress] = []
        i += 1
        while True:
            call = scan_call(text, i, "parameters")
            found.append(call)
            if call.end is None:
                return found
            rest = text[call.end :].lstrip()
            if not rest.startswith(","):
                return found
            i = len(text) - len(rest) + 1

    def _hermes_calls(self) -> list[CallProgress]:
        """The ``<tool_call>{"name": ..., "arguments": {...}}`` blocks so far."""
        found: list[CallProgress] = []
        start = self.text.find(HermesParser.START)
        while start >= 0:
            call = scan_call(self.text, start + len(HermesParser.START), "arguments")
            found.append(call)
            if call.end is None:
                break
            start = self.text.find(HermesParser.START, call.end)
        return found

    def _call_deltas(self, progress: list[CallProgress]) -> list[CallDelta]:
        deltas: list[CallDelta] = []
        for index, call in enumerate(progress):
            if index == len(self.calls):
                if call.name is None or call.name not in self.names:
                    break  # not a known call (yet): nothing after it streams
                deltas.append(self._header(index, call.name))
                self.calls.append((call.name, ""))
            name, sent = self.calls[index]
            if call.name != name or not call.arguments.startswith(sent):
                self._broken = True  # cannot happen for JSON without duplicate keys
                break
            if len(call.arguments) > len(sent):
                deltas.append(self._fragment(index, call.arguments[len(sent) :]))
                self.calls[index] = (name, call.arguments)
        return deltas

    def _final_deltas(self, calls: list[ParsedCall]) -> list[CallDelta]:
        """The fragments that complete the started calls, then the calls not yet started."""
        deltas: list[CallDelta] = []
        for index, call in enumerate(calls):
            if index < len(self.calls):
                name, sent = self.calls[index]
                if name != call.name or not call.arguments.startswith(sent):
                    logger.warning("a streamed tool call differs from its final parse")
                    continue
            else:
                deltas.append(self._header(index, call.name))
                sent = ""
            if len(call.arguments) > len(sent):
                deltas.append(self._fragment(index, call.arguments[len(sent) :]))
        return deltas

    @staticmethod
    def _header(index: int, name: str) -> CallDelta:
        function = DeltaFunctionCall(name=name, arguments="")
        return [DeltaToolCall(index=index, id=new_call_id(), type="function", function=function)]

    @staticmethod
    def _fragment(index: int, arguments: str) -> CallDelta:
        return [DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments))]
